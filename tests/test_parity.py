"""Parity with the oracle (torch.optim, or for an algorithm torch lacks its reference
package: schedulefree, prodigyopt, pytorch_optimizer): every registered algorithm x every
hyperparameter combination torch accepts (eager float32; float64 and scripted
over the pairwise cover ``spec.pairs()``, see ``_cases``) x fused/foreach,
20 steps of fresh random gradients with some ``None``.

funcopt runs the same kernels as torch.optim here (the fused ATen kernel, or
the foreach ops in torch's order), so parameters, state and param_groups must
be *bitwise* equal (``torch.equal``), not merely close.
"""
import pytest
import torch

import funcopt
from _oracles import same_value
from funcopt.registry import REGISTRY

STEPS = 20
IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True)}


def _params(dtype, spec):
    g = torch.Generator().manual_seed(0)
    shapes = [spec.param_shape(s) for s in [(7, 3), (5,), (), (2, 2, 2), (0,)]]  # Muon: matrices
    return [torch.randn(s, dtype=dtype, generator=g) for s in shapes]


def _grads(params, step, gen, with_none):
    gs = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    if with_none and step in (0, 4):
        gs[1] = None  # never stepped at first, then skipped again: state untouched
    if step == 9:
        gs[3] = None
    return gs


def _assert_same(fo, to, fparams, tparams):
    for a, b in zip(fparams, tparams):
        assert torch.equal(a, b), (a, b)
    fs, ts = fo.state_dict(), to.state_dict()
    assert fs["param_groups"] == ts["param_groups"]
    assert fs["state"].keys() == ts["state"].keys()
    for i, entry in ts["state"].items():
        assert fs["state"][i].keys() == entry.keys()
        for k, v in entry.items():
            got = fs["state"][i][k]
            # prodigyopt's int step and 0-d p0, SOAP's lists and numbers (tests/_oracles.py)
            assert same_value(got, v), (i, k, got, v)


def _cases():
    """Eager float32: every grid point.  Float64 and scripted (a scripted step
    costs ~10x an eager one): the pairwise cover ``spec.pairs()`` -- every
    value of every option and every pair of values still meets each dtype,
    impl and mode (``FUNCOPT_FULL_GRID=1``: every grid point everywhere).
    Fused only where torch has a fused CPU kernel (others have nothing to
    compare with)."""
    for name, spec in REGISTRY.items():
        pairs = spec.pairs()
        impls = [i for i in IMPLS if i != "fused" or "cpu" in spec.fused_devices]
        for j, kw in enumerate(spec.combos()):
            for dtype, dname in ((torch.float32, "f32"), (torch.float64, "f64")):
                for impl in impls:
                    for scripted, mname in ((False, "eager"), (True, "scripted")):
                        if (dname, mname) != ("f32", "eager") and kw not in pairs:
                            continue
                        yield pytest.param(name, kw, dtype, impl, scripted, id=f"{name}-{j}-{dname}-{impl}-{mname}")


@pytest.mark.parametrize("name,kw,dtype,impl,scripted", list(_cases()))
def test_matches_torch_optim(name, kw, dtype, impl, scripted):
    spec = REGISTRY[name]
    base = _params(dtype, spec)
    fparams = [p.clone().requires_grad_() for p in base]
    tparams = [p.clone().requires_grad_() for p in base]
    fo = spec.cls(fparams, **kw, **spec.torch_flags(IMPLS[impl]))
    if scripted:
        funcopt.script(fo)
    to = spec.torch_cls(tparams, **kw, **spec.torch_flags(IMPLS[impl]))
    if spec.cls.has_modes:
        to.train()  # Schedule-Free's oracle starts in eval mode (funcopt's in train mode)
    gen = torch.Generator().manual_seed(1)
    # torch's fused SGD cannot take a first step with some momentum buffers
    # missing (it indexes None); keep the None-at-step-0 case to the others.
    with_none = not (impl == "fused" and spec.cls.split_first)
    for step in range(STEPS):
        grads = _grads(base, step, gen, with_none)
        fo.step(grads)
        for p, g in zip(tparams, grads):
            p.grad = None if g is None else g.clone()  # oracles outside torch may write into p.grad
        to.step()
    _assert_same(fo, to, fparams, tparams)


def test_every_algorithm_has_a_grid():
    for name, spec in REGISTRY.items():
        combos = list(spec.combos())
        assert len(combos) >= 8, name
        # every boolean flag in the grid is exercised both ways
        for key, values in spec.grid.items():
            seen = {c[key] if not isinstance(c[key], tuple) else c[key] for c in combos}
            assert len(seen) == len(values), (name, key, seen)

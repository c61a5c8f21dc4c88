"""The cache-blocked foreach fallback (``Core._blocked``, funcopt/optimizers/_core.py).

Where a CPU bucket runs the foreach formula under ``impl="auto"`` (no native
library: ``FUNCOPT_NATIVE=0``, no compiler -- here ``native.disable()``; or a
dtype without a fused kernel: complex), an elementwise rule runs it over
cache-sized blocks: small tensors grouped whole, large contiguous ones cut into
flat chunks.  It must be bitwise the unblocked formula, i.e. bitwise
``torch.optim.<Name>(foreach=True)``: every elementwise registry algorithm,
float32 and float64 (complex for those whose real dtypes take a fused kernel),
eager and scripted, 10 steps with ``None`` gradients, a strided parameter and
a strided gradient, with ``BLOCK_BYTES`` patched small so that tensors of a
few hundred elements are cut.  NAdam's ``mu_product`` and ASGD's ``eta`` /
``mu`` (0-d state the rule writes, shared by a tensor's chunks) are what the
snapshot-and-restore keeps exact.  ``impl="foreach"`` (torch's call
sequence), whole-parameter rules and ``differentiable=True`` never block.
"""
from __future__ import annotations

import pytest
import torch

import funcopt
from funcopt import native
from funcopt.optimizers import _core
from funcopt.registry import REGISTRY

BLOCKING = {name: spec for name, spec in REGISTRY.items() if not spec.whole_params and spec.cls.phases == 1}
STEPS = 10
BLOCK = 2048  # bytes: 512 float32 / 256 float64 elements per block
# a chunked vector, a chunked matrix, small ones grouped, a 0-d, an empty one, and (last two)
# a transposed parameter (never cut: a block by itself) and one that gets a strided gradient
SHAPES = [(1000,), (7, 3), (41, 30), (5,), (), (0,), (2, 2, 2), (300,), (30, 40), (700,)]
TRANSPOSED, STRIDED_GRAD = 8, 9


def _dtypes(spec):
    """Real dtypes where the CPU bucket runs the foreach formula (a native rule, disabled
    here, and no ATen fused kernel: not SGD), else complex ones (no fused kernel takes them)."""
    if (spec.native_rule and "cpu" not in spec.fused_devices) or spec.oracle_package is not None:
        return [torch.float32, torch.float64]  # (the rules beyond torch: no native rule, no fused kernel)
    return [torch.complex64, torch.complex128]


def _cases():
    for name, spec in BLOCKING.items():
        for dtype in _dtypes(spec):
            for scripted in (False, True):
                yield pytest.param(name, dtype, scripted,
                                   id=f"{name}-{str(dtype)[6:]}-{'script' if scripted else 'eager'}")


def _init(dtype):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, s in enumerate(SHAPES):
        if i == TRANSPOSED:
            out.append(torch.randn(tuple(reversed(s)), generator=g, dtype=dtype).t())
        else:
            out.append(torch.randn(s, generator=g, dtype=dtype))
    return out


def _grads(init, step, gen):
    gs = []
    for i, p in enumerate(init):
        if i == STRIDED_GRAD:
            gs.append(torch.randn(p.numel() * 2, generator=gen, dtype=p.dtype)[::2])
        else:
            gs.append(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    if step in (0, 4):
        gs[0] = None
    if step in (3, 7):
        gs[2] = None
        gs[3] = None
    return gs


def _count_dense(opt):
    """Record each kernel.dense call's list of parameter sizes (eager cores)."""
    kernel = opt._core.kernel
    calls = []
    dense = kernel.dense

    def counted(params, *a):
        calls.append([p.numel() for p in params])
        return dense(params, *a)

    kernel.dense = counted
    return calls


def _foreach_ops(opt, grads):
    """Step, counting the ``aten::_foreach_*`` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step(grads)
    return sum(1 for e in prof.events() if e.name.startswith("aten::_foreach_"))


def _leaf(t):
    return t.detach().clone(memory_format=torch.preserve_format).requires_grad_()


def _compare(fo, fp, other, op, what):
    for i, (a, b) in enumerate(zip(fp, op)):
        assert torch.equal(a, b), f"{what}: param {i}"
    fs, ts = fo.state_dict()["state"], other.state_dict()["state"]
    assert fs.keys() == ts.keys(), what
    for i, entry in ts.items():
        assert fs[i].keys() == entry.keys(), (what, i)
        for k, v in entry.items():
            assert fs[i][k].dtype == v.dtype and torch.equal(fs[i][k], v), f"{what}: state {i} {k}"


@pytest.mark.parametrize("name,dtype,scripted", list(_cases()))
def test_blocked_is_torch_foreach_bitwise(name, dtype, scripted, monkeypatch):
    spec = BLOCKING[name]
    kw = dict(spec.rich)
    if not spec.takes((3,), dtype):
        pytest.skip(f"torch.optim.{name} does not take {dtype}")
    monkeypatch.setattr(_core, "BLOCK_BYTES", BLOCK)
    init = _init(dtype)
    fp = [_leaf(p) for p in init]
    ep = [_leaf(p) for p in init]  # funcopt impl="foreach": the unblocked formula
    tp = [_leaf(p) for p in init]
    assert not fp[TRANSPOSED].is_contiguous()
    with native.disable():
        fo = spec.cls(fp, **kw)
    fe = spec.cls(ep, impl="foreach", **kw)
    assert not fo.uses_native and fo.impl == "auto" and fo._core.block == BLOCK and fe._core.block == 0
    calls = None
    if scripted:
        funcopt.script(fo)
    else:
        calls = _count_dense(fo)
    to = spec.torch_cls(tp, **spec.torch_flags(dict(kw, foreach=True)))
    gen = torch.Generator().manual_seed(1)
    ops = {}
    for t in range(STEPS):
        gs = _grads(init, t, gen)
        if scripted and t == STEPS - 1:  # the ops each runs: blocked calls each op many times
            ops = {"blocked": _foreach_ops(fo, gs), "foreach": _foreach_ops(fe, gs)}
        else:
            fo.step(gs)
            fe.step(gs)
        for p, g in zip(tp, gs):
            p.grad = None if g is None else g.clone()
        to.step()
    _compare(fo, fp, fe, ep, f"{name} {dtype} vs impl='foreach'")
    # torch's foreach SGD steps complex tensors as complex (funcopt: through real views, as
    # every other torch rule does): some elements round differently, blocked or not
    if not (name == "SGD" and dtype.is_complex):
        _compare(fo, fp, to, tp, f"{name} {dtype} vs torch.optim foreach")
    if scripted:
        assert ops["blocked"] > 3 * ops["foreach"], (name, ops)
    if calls is not None:
        # blocked: many calls per step, each within a block, but for the transposed
        # parameter (whole, alone) and the strided-gradient one (whole)
        real = dtype.to_real()  # complex parameters are stepped through real views
        limit = BLOCK // torch.empty((), dtype=real).element_size()
        per = 2 if dtype.is_complex else 1
        assert len(calls) > 4 * STEPS, (name, len(calls))
        whole = {per * init[TRANSPOSED].numel(), per * init[STRIDED_GRAD].numel()}
        for sizes in calls:
            assert sum(sizes) <= limit or (len(sizes) == 1 and sizes[0] in whole), (name, sizes)
        assert any(len(sizes) == 1 and 0 < sizes[0] < 1000 and sizes[0] % 64 == 0 for sizes in calls), name


@pytest.mark.parametrize("name", list(REGISTRY))
def test_foreach_and_whole_parameter_rules_never_block(name, monkeypatch):
    spec = REGISTRY[name]
    monkeypatch.setattr(_core, "BLOCK_BYTES", BLOCK)
    shape = spec.param_shape((40, 30))
    init = [torch.randn(shape) for _ in range(3)]
    with native.disable():
        auto = spec.cls([_leaf(p) for p in init], **spec.base)
        fe = spec.cls([_leaf(p) for p in init], impl="foreach", **spec.base)
    assert fe._core.block == 0
    # a two-phase rule (Prodigy) keeps its per-parameter sums in the oracle's order: never cut
    assert auto._core.block == (0 if spec.whole_params or spec.cls.phases != 1 else BLOCK)
    calls = _count_dense(fe)
    for _ in range(2):
        fe.step([torch.randn(shape) for _ in init])
    # one call per bucket and step (and pass: Prodigy's two): torch's sequence
    assert calls == [[p.numel() for p in init]] * 2 * spec.cls.phases


def test_scripted_core_keeps_the_setting(monkeypatch):
    monkeypatch.setattr(_core, "BLOCK_BYTES", BLOCK)
    with native.disable():
        opt = funcopt.RMSprop([torch.zeros(10, requires_grad=True)])
    funcopt.script(opt)
    assert opt._core.block == BLOCK


def test_differentiable_does_not_block(monkeypatch):
    monkeypatch.setattr(_core, "BLOCK_BYTES", BLOCK)
    w = torch.randn(2000)
    with native.disable():
        opt = funcopt.RMSprop([w], differentiable=True)
    calls = _count_dense(opt)
    opt.step([torch.randn(2000)])
    assert calls == []  # the per-tensor formula, with autograd


def test_disable_is_scoped():
    with native.disable():
        assert native._mode() == "off"
        with native.disable():
            assert native.load() is None
        assert native._mode() == "off"
    assert native._state["disabled"] == 0

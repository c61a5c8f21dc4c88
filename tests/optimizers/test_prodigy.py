"""Prodigy: ``funcopt.Prodigy`` against its oracle, ``prodigyopt.Prodigy`` (1.1.2, a
test dependency).

Bitwise (``torch.equal``) in float32 and float64, eager and scripted, over 25
steps with ``None`` gradients (a parameter whose first gradient comes late, one
skipped mid-run), 0-d and non-contiguous parameters, every option (the default
tier the registry's pairwise cover, the rest tier its whole grid), several param
groups (one with ``lr=0``: the oracle's only allowed difference), the first-pass
sums as the two-phase core computes them (``begin``/``partials``/``finish`` with
a split of the parameters adds up to the one-process step), state dicts moved
both ways between the two classes and stepped on, invalid options and inputs
refused with nothing changed.  The oracle writes coupled weight decay into
``p.grad``: it gets clones.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import funcopt
from funcopt.registry import REGISTRY

prodigyopt = pytest.importorskip("prodigyopt")

STEPS = 25
SPEC = REGISTRY["Prodigy"]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, dtype=dtype, generator=g) for s in [(7, 3), (5,), ()]]
    out.append(torch.randn(4, 6, dtype=dtype, generator=g).t())  # not contiguous
    out.append(torch.zeros(3, dtype=dtype))  # all zero: the oracle's 0-d p0
    return [p.requires_grad_() for p in out]


def _grads(params, step, gen):
    gs = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    if step < 4:
        gs[1] = None
    if step == 9:
        gs[3] = None
    return gs


def _oracle_step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    opt.step()


def _groups_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (sorted(x), sorted(y))
        for k in x:
            assert x[k] == y[k] or (x[k] != x[k] and y[k] != y[k]), (k, x[k], y[k])


def _assert_same(fo, ref, fparams, rparams):
    for i, (a, b) in enumerate(zip(fparams, rparams)):
        assert torch.equal(a.detach(), b.detach()), (i, (a - b).abs().max())
    fs, rs = fo.state_dict(), ref.state_dict()
    _groups_equal(fs["param_groups"], rs["param_groups"])
    assert fs["state"].keys() == rs["state"].keys()
    for i, entry in rs["state"].items():
        assert fs["state"][i].keys() == entry.keys(), (i, sorted(fs["state"][i]), sorted(entry))
        for k, v in entry.items():
            got = fs["state"][i][k]
            if k == "step":
                assert got == v, (i, got, v)
            elif k == "p0" and v.dim() == 0:  # the oracle's 0-d zero for an all-zero start
                assert torch.equal(got, torch.zeros_like(got)), (i, got)
            else:
                assert torch.equal(got, v), (i, k, (got - v).abs().max())


def _run(kw, dtype, scripted, groups=None):
    fparams, rparams = _params(dtype), _params(dtype)
    if groups is None:
        fo, ro = funcopt.Prodigy(fparams, **kw), prodigyopt.Prodigy(rparams, **kw)
    else:
        fo = funcopt.Prodigy(groups(fparams), **kw)
        ro = prodigyopt.Prodigy(groups(rparams), **kw)
    if scripted:
        funcopt.script(fo)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = _grads(fparams, step, gen)
        fo.step(grads)
        _oracle_step(ro, rparams, grads)
    return fo, ro, fparams, rparams


def _cases():
    import os

    full = os.environ.get("FUNCOPT_FULL_GRID", "") not in ("", "0")
    points = list(SPEC.combos()) if full else SPEC.pairs()
    for j, kw in enumerate(points):
        for dtype in (torch.float32, torch.float64):
            for scripted in (False, True):
                if scripted and dtype == torch.float64 and j % 2:
                    continue  # scripted float64 on every other point of the cover
                yield pytest.param(kw, dtype, scripted, id=f"{j}-{str(dtype)[6:]}-{'scripted' if scripted else 'eager'}")


@pytest.mark.parametrize("kw,dtype,scripted", list(_cases()))
def test_matches_prodigyopt(kw, dtype, scripted, capsys):
    fo, ro, fp, rp = _run(kw, dtype, scripted)
    _assert_same(fo, ro, fp, rp)


@pytest.mark.parametrize("kw", [dict(beta3=0.9, growth_rate=1.02), dict(d_coef=0.5, growth_rate=float("inf")),
                                dict(d0=1e-3, beta3=0.5, eps=1e-4, weight_decay=0.1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_options_beyond_the_registry_grid(kw, dtype, capsys):
    fo, ro, fp, rp = _run(kw, dtype, False)
    _assert_same(fo, ro, fp, rp)


@pytest.mark.parametrize("scripted", [False, True])
def test_groups_one_with_lr_zero(scripted, capsys):
    """d is one estimate over every group; a group with lr=0 takes no first pass (the oracle's rule)."""
    def groups(ps):
        return [dict(params=ps[:2], weight_decay=0.1), dict(params=ps[2:4]), dict(params=ps[4:], lr=0.0)]

    fo, ro, fp, rp = _run(dict(lr=1.0, d_coef=2.0), torch.float32, scripted, groups)
    _assert_same(fo, ro, fp, rp)
    assert fo.param_groups[0]["d"] == fo.param_groups[1]["d"] == fo.param_groups[2]["d"] > 1e-6


def test_different_nonzero_lrs_refused_unchanged():
    ps = _params(torch.float32)
    opt = funcopt.Prodigy([dict(params=ps[:2]), dict(params=ps[2:], lr=0.5)])
    before = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match="different lr values"):
        opt.step([torch.ones_like(p) for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    assert opt.param_groups[0]["k"] == 0 and not opt.state
    opt.param_groups[1]["lr"] = 0.0  # allowed: then the step runs
    opt.step([torch.ones_like(p) for p in ps])
    assert opt.param_groups[0]["k"] == 1


def test_split_sums_equal_one_process():
    """What ZeRO / FSDP2 / the RPC optimizer do: two optimizers over two halves of the
    parameters, their first-pass sums added (``sum_partials``), equal the one-process step."""
    whole = _params(torch.float64)
    a_params, b_params = _params(torch.float64)[:3], _params(torch.float64)[3:]
    kw = dict(weight_decay=0.1, use_bias_correction=True, d_coef=3.0)
    one = funcopt.Prodigy(whole, **kw)
    a, b = funcopt.Prodigy(a_params, **kw), funcopt.Prodigy(b_params, **kw)
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in whole]
        one.step(grads)
        ca, cb = a.core, b.core
        ca.begin(grads[:3], None, None)
        cb.begin(grads[3:], None, None)
        total = ca.partials() + cb.partials()
        ca.finish(total)
        cb.finish(total)
    for x, y in zip(whole, a_params + b_params):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-15)
    assert a.state_dict()["param_groups"][0]["k"] == 12
    assert abs(a.state_dict()["param_groups"][0]["d"] - one.param_groups[0]["d"]) <= 1e-12 * one.param_groups[0]["d"]


@pytest.mark.parametrize("direction", ["oracle_to_funcopt", "funcopt_to_oracle"])
def test_state_dict_both_ways(direction, capsys):
    kw = dict(weight_decay=0.1, slice_p=2)
    fo, ro, fp, rp = _run(kw, torch.float32, False)
    fp2, rp2 = [p.detach().clone().requires_grad_() for p in fp], [p.detach().clone().requires_grad_() for p in rp]
    if direction == "oracle_to_funcopt":
        src_params, src = rp2, prodigyopt.Prodigy(rp2, **kw)
        src.load_state_dict(copy.deepcopy(ro.state_dict()))
        dst_params, dst = fp2, funcopt.Prodigy(fp2, **kw)
        dst.load_state_dict(copy.deepcopy(ro.state_dict()))
    else:
        src_params, src = fp2, funcopt.Prodigy(fp2, **kw)
        src.load_state_dict(copy.deepcopy(fo.state_dict()))
        dst_params, dst = rp2, prodigyopt.Prodigy(rp2, **kw)
        dst.load_state_dict(copy.deepcopy(fo.state_dict()))
    gen = torch.Generator().manual_seed(7)
    for step in range(6):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in fp]
        for opt, params in ((src, src_params), (dst, dst_params)):
            if isinstance(opt, funcopt.Prodigy):
                opt.step(grads)
            else:
                _oracle_step(opt, params, grads)
    for x, y in zip(src_params, dst_params):
        assert torch.equal(x, y)


def test_invalid_options_refused():
    p = torch.zeros(2, requires_grad=True)
    for kw, match in [(dict(lr=0.0), "Invalid learning rate"), (dict(d0=-1.0), "Invalid d0"),
                      (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
                      (dict(beta3=1.5), "Invalid beta3"), (dict(slice_p=0), "slice_p"),
                      (dict(eps=0.0), "Invalid epsilon")]:
        with pytest.raises(ValueError, match=match):
            funcopt.Prodigy([p], **kw)
    with pytest.raises(TypeError):
        funcopt.Prodigy([p], slice_p=1.5)
    opt = funcopt.Prodigy([p])
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step([torch.sparse_coo_tensor([[0]], [1.0], (2,))])
    opt.param_groups[0]["k"] = "three"
    with pytest.raises(TypeError, match="'k'"):
        opt.step([torch.ones(2)])
    assert torch.equal(p, torch.zeros(2)) and not opt.state


def test_amp_skip_changes_nothing():
    ps = _params(torch.float32)
    opt = funcopt.Prodigy(ps)
    opt.step([torch.ones_like(p) for p in ps])
    before = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in ps]
    opt.step([torch.ones_like(p) for p in ps], found_inf=torch.ones((), dtype=torch.float32),
             grad_scale=torch.full((), 4.0))
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(a, b) for a, b in zip(values, ps))
    for i, e in before["state"].items():
        for k, v in e.items():
            assert (v == after["state"][i][k]) if k == "step" else torch.equal(v, after["state"][i][k])


def test_complex_parameters_refused_unchanged():
    """funcopt refuses complex parameters (prodigyopt runs them through a complex dot product
    and a complex d: not a step size)."""
    p = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    q = torch.randn(2, requires_grad=True)
    before = (p.detach().clone(), q.detach().clone())
    opt = funcopt.Prodigy([q, p])
    with pytest.raises(RuntimeError, match="complex"):
        opt.step([torch.ones(2), torch.ones(3, dtype=torch.complex64)])
    assert torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1])
    assert not opt.state and opt.param_groups[0]["k"] == 0

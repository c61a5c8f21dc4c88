"""ADOPT: ``funcopt.ADOPT`` against its oracle, ``pytorch_optimizer.ADOPT``
(pytorch-optimizer 4.1.0, a test dependency).

Bitwise (``torch.equal``) in float32 and float64, eager and scripted, over
>= 20 steps with ``None`` gradients (a parameter whose first gradient comes
late, one skipped mid-run), 0-d, empty and non-contiguous parameters, every
option (the default tier a covering set, the rest tier the registry's whole
grid); a param group without gradients still counts its steps; complex
parameters (the oracle's per-parameter path through real views) and
bfloat16; sparse gradients refused with nothing changed; ``torch.compile``
(fullgraph) against eager within rtol 1e-5; state dicts moved both ways
between the two classes, then both keep stepping; ``clip_lambda``'s values.
The oracle negates and decays ``p.grad`` in place: it gets clones.
"""
from __future__ import annotations

import copy
import doctest
import inspect
import math

import pytest
import torch

import funcopt
from funcopt.optimizers import adopt as adopt_module
from funcopt.optimizers.adopt import default_clip_lambda
from funcopt.registry import REGISTRY

from _oracle_case import assert_same, make_grads, make_params, oracle_step, parity

po = pytest.importorskip("pytorch_optimizer")

STEPS = 22
SPEC = REGISTRY["ADOPT"]

CONFIGS = [
    dict(lr=0.01),
    dict(lr=0.01, clip_lambda=None),
    dict(lr=0.02, betas=(0.5, 0.9), weight_decay=0.1, maximize=True),
    dict(lr=0.01, weight_decay=0.1, weight_decouple=True, eps=1e-3),
    dict(lr=0.01, weight_decay=0.3, weight_decouple=True, fixed_decay=True, clip_lambda=None, maximize=True),
]

SLOTS = ["exp_avg", "exp_avg_sq"]
_params, _grads, _oracle_step = make_params, make_grads, oracle_step


def _assert_same(fo, ref, fparams, rparams, exact=True):
    assert_same(fo, ref, fparams, rparams, SLOTS, exact)


def _parity(cfg, dtype, mode, steps=STEPS):
    parity(funcopt.ADOPT, po.ADOPT, SLOTS, cfg, dtype, mode, steps)


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_parity(cfg, dtype, mode):
    _parity(cfg, dtype, mode)


@pytest.mark.rest
@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_parity_whole_grid(dtype, mode):
    for kw in SPEC.combos():
        _parity(kw, dtype, mode)


def test_the_default_covers_the_registry_grid():
    """CONFIGS above: every option of the grid, each value at least once."""
    for key, values in SPEC.grid.items():
        for v in values:
            if key == "clip_lambda" and v is default_clip_lambda:
                continue  # the default: every config without clip_lambda
            assert any(key in c and c[key] == v or key not in c and inspect.signature(
                funcopt.ADOPT.__init__).parameters[key].default == v for c in CONFIGS), (key, v)


def test_first_step_only_fills_the_second_moment():
    """Step 1 (the group's): weight decay, then ``exp_avg_sq += g * g``; the
    parameter moves by the decay alone and ``exp_avg`` stays zero -- as the oracle."""
    for kw in (dict(weight_decay=0.5, weight_decouple=True), dict(weight_decay=0.5), {}):
        fp, rp = _params(torch.float64), _params(torch.float64)
        fo, ref = funcopt.ADOPT(fp, lr=0.1, **kw), po.ADOPT(rp, lr=0.1, **kw)
        grads = _grads(fp, 6, torch.Generator().manual_seed(3))
        fo.step(grads)
        _oracle_step(ref, rp, grads)
        _assert_same(fo, ref, fp, rp)
        for p, p0 in zip(fp, _params(torch.float64)):
            assert torch.equal(fo.state[p]["exp_avg"], torch.zeros_like(p))
            if p.numel():
                assert torch.equal(p.detach(), p0.detach()) == (not kw.get("weight_decouple"))


def test_group_without_gradients_counts_its_steps():
    """Every group's ``step`` moves on every step() (the oracle's rule), also
    a group none of whose parameters has a gradient; its first step with
    gradients is then not a first step."""
    def groups(params):
        return [dict(params=params[:2]), dict(params=params[2:], lr=0.05, clip_lambda=None)]

    fp, rp = _params(torch.float32), _params(torch.float32)
    fo, ref = funcopt.ADOPT(groups(fp), lr=0.01), po.ADOPT(groups(rp), lr=0.01)
    gen = torch.Generator().manual_seed(2)
    for step in range(8):
        grads = _grads(fp, 6, gen)
        if step < 4:
            grads[2:] = [None] * (len(grads) - 2)
        fo.step(grads)
        _oracle_step(ref, rp, grads)
        assert [g["step"] for g in fo.param_groups] == [g["step"] for g in ref.param_groups] == [step + 1] * 2
    # the oracle keeps clip_lambda on the instance: its second group clips (ours does not) --
    # compare the first group only, and the second against a one-group oracle without clipping
    for a, b in zip(fp[:2], rp[:2]):
        assert torch.equal(a, b)
    assert fo.param_groups[1]["clip_lambda"] is None and fo.param_groups[0]["clip_lambda"] == "step ** 0.25"
    rp2 = _params(torch.float32)[2:]
    ref2 = po.ADOPT(rp2, lr=0.05, clip_lambda=None)
    gen = torch.Generator().manual_seed(2)
    for step in range(8):
        grads = _grads(fp, 6, gen)[2:]
        _oracle_step(ref2, rp2, [None] * len(grads) if step < 4 else grads)
    for a, b in zip(fp[2:], rp2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_parameters(dtype):
    """The oracle's per-parameter path through real views (it takes no foreach
    path for complex parameters): bitwise the same."""
    def make():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(s, dtype=dtype, generator=g).requires_grad_() for s in [(4, 3), (5,)]]

    fp, rp = make(), make()
    cfg = dict(lr=0.01, weight_decay=0.1, maximize=True)
    fo, ref = funcopt.ADOPT(fp, **cfg), po.ADOPT(rp, **cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, dtype=dtype, generator=gen) for p in fp]
        fo.step(grads)
        _oracle_step(ref, rp, grads)
    for a, b in zip(fp, rp):
        assert a.dtype == dtype and torch.equal(a, b)
    for a, b in zip(fp, rp):
        for k in ("exp_avg", "exp_avg_sq"):
            assert fo.state[a][k].dtype == dtype and torch.equal(fo.state[a][k], ref.state[b][k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    fp, rp = _params(dtype), _params(dtype)
    cfg = dict(lr=0.01, weight_decay=0.1, weight_decouple=True)
    fo, ref = funcopt.ADOPT(fp, **cfg), po.ADOPT(rp, **cfg)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = _grads(fp, step, gen)
        fo.step(grads)
        _oracle_step(ref, rp, grads)
    _assert_same(fo, ref, fp, rp)


def test_sparse_gradient_refused():
    p = torch.randn(4, 3, requires_grad=True)
    q = torch.randn(5, requires_grad=True)
    opt = funcopt.ADOPT([p, q], lr=0.1)
    opt.step([torch.randn(4, 3), torch.randn(5)])
    before = (p.detach().clone(), q.detach().clone(), opt.state_dict())
    sparse = torch.randn(4, 3).to_sparse()
    for scripted in (False, True):
        if scripted:
            funcopt.script(opt)
        with pytest.raises(RuntimeError, match="ADOPT does not support sparse gradient"):
            opt.step([sparse, torch.randn(5)])
        assert torch.equal(p, before[0]) and torch.equal(q, before[1])
        assert opt.param_groups[0]["step"] == 1
    ref = po.ADOPT([torch.randn(4, 3, requires_grad=True)])
    ref.param_groups[0]["params"][0].grad = sparse
    with pytest.raises(Exception, match="does not support sparse gradient"):
        ref.step()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.rest)])
@pytest.mark.parametrize("cfg", [dict(lr=0.01, weight_decay=0.1, maximize=True),
                                 pytest.param(dict(lr=0.01, clip_lambda=None, weight_decay=0.1, weight_decouple=True),
                                              marks=pytest.mark.rest)],
                         ids=["clip", "noclip"])
def test_compile_fullgraph(cfg, backend):
    """``torch.compile(fullgraph=True)`` of a function that steps: from the
    first step (compiled too: the first-step rule has no host branch), with a
    ``None`` gradient, against eager funcopt (and eager against the oracle).
    ``aot_eager`` traces like inductor (Dynamo, AOTAutograd) without building
    C++; inductor itself (tens of seconds) in the rest tier."""
    torch._dynamo.reset()
    try:
        pe, pc, rp = _params(torch.float32), _params(torch.float32), _params(torch.float32)
        eager, compiled_opt, ref = funcopt.ADOPT(pe, **cfg), funcopt.ADOPT(pc, **cfg), po.ADOPT(rp, **cfg)

        @torch.compile(fullgraph=True, backend=backend)
        def step(grads):
            compiled_opt.step(grads)

        gen = torch.Generator().manual_seed(1)
        for i in range(4):
            grads = _grads(pe, 9 if i == 2 else 6, gen)
            eager.step(grads)
            step(grads)
            _oracle_step(ref, rp, grads)
        _assert_same(eager, ref, pe, rp)
        _assert_same(compiled_opt, eager, pc, pe, exact=False)
        assert compiled_opt.param_groups[0]["step"] == 4
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("direction", ["ours_to_oracle", "oracle_to_ours"])
@pytest.mark.parametrize("cfg", [dict(lr=0.01, weight_decay=0.1, maximize=True),
                                 dict(lr=0.01, clip_lambda=None, weight_decouple=True, weight_decay=0.1)],
                         ids=["clip", "noclip"])
def test_state_dict_both_ways(cfg, direction):
    """Steps on one class, its state dict loaded into the other (fresh, same
    hyperparameters, the parameters copied), then both keep stepping from the
    same state: bitwise equal to an uninterrupted oracle."""
    dtype = torch.float64
    gen = torch.Generator().manual_seed(1)
    plan = [_grads(_params(dtype), step, gen) for step in range(2 * 7)]
    first_cls, second_cls = (funcopt.ADOPT, po.ADOPT) if direction == "ours_to_oracle" else (po.ADOPT, funcopt.ADOPT)

    def stepper(opt, params):
        if isinstance(opt, funcopt.ADOPT):
            return opt.step
        return lambda grads: _oracle_step(opt, params, grads)

    p1 = _params(dtype)
    o1 = first_cls(p1, **cfg)
    for grads in plan[:7]:
        stepper(o1, p1)(grads)
    sd = copy.deepcopy(o1.state_dict())  # as saved: torch.optim's load keeps the tensors it is given
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    o2 = second_cls(p2, **cfg)
    o2.load_state_dict(sd)
    assert o2.param_groups[0]["step"] == 7
    pr = _params(dtype)
    ref = po.ADOPT(pr, **cfg)
    for grads in plan:
        _oracle_step(ref, pr, grads)
    for grads in plan[7:]:
        stepper(o2, p2)(grads)
        stepper(o1, p1)(grads)
    ours, ours_p = (o2, p2) if second_cls is funcopt.ADOPT else (o1, p1)
    theirs, theirs_p = (o1, p1) if second_cls is funcopt.ADOPT else (o2, p2)
    _assert_same(ours, ref, ours_p, pr)
    _assert_same(ours, theirs, ours_p, theirs_p)


def test_state_dict_format_and_weights_only_load(tmp_path):
    """The oracle's param-group keys (``clip_lambda``/``maximize`` left out where
    they are the constructor's, kept where a group has its own), and a file
    ``torch.load(weights_only=True)`` reads: no pickled functions."""
    p, q = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    opt = funcopt.ADOPT([dict(params=[p]), dict(params=[q], clip_lambda=None)], lr=0.1)
    opt.step([torch.randn(3), torch.randn(2)])
    ref = po.ADOPT([torch.randn(3, requires_grad=True)], lr=0.1)
    ref.param_groups[0]["params"][0].grad = torch.randn(3)
    ref.step()
    sd = opt.state_dict()
    assert set(sd["param_groups"][0]) == set(ref.state_dict()["param_groups"][0])
    assert sd["param_groups"][1]["clip_lambda"] is None
    torch.save(sd, tmp_path / "adopt.pt")
    loaded = torch.load(tmp_path / "adopt.pt", weights_only=True)
    fresh = funcopt.ADOPT([dict(params=[p.detach().clone().requires_grad_()]),
                           dict(params=[q.detach().clone().requires_grad_()])], lr=0.1)
    fresh.load_state_dict(loaded)
    assert [g["clip_lambda"] for g in fresh.param_groups] == ["step ** 0.25", None]
    assert [g["step"] for g in fresh.param_groups] == [1, 1]
    # the other way: our defaults differ from the saved oracle's instance -- ours are kept
    mine = funcopt.ADOPT([torch.randn(3, requires_grad=True)], lr=0.1, clip_lambda=None, maximize=True)
    mine.load_state_dict(ref.state_dict())
    assert mine.param_groups[0]["clip_lambda"] is None and mine.param_groups[0]["maximize"] is True
    assert mine.param_groups[0]["step"] == 1
    # an oracle that never stepped has no 'step' in its groups (it adds it at the first step()):
    # loaded, the counter restarts at 0, and ours leaves it out of its state dict again
    mine.load_state_dict(po.ADOPT([torch.randn(3, requires_grad=True)], lr=0.1).state_dict())
    assert "step" not in mine.param_groups[0] and "step" not in mine.state_dict()["param_groups"][0]
    assert mine.state_dict()["state"] == {}


def test_clip_lambda_values():
    p = torch.zeros(2, requires_grad=True)
    oracle_default = inspect.signature(po.ADOPT.__init__).parameters["clip_lambda"].default
    for value, stored in [(default_clip_lambda, "step ** 0.25"), (oracle_default, "step ** 0.25"),
                          ("step ** 0.25", "step ** 0.25"), (None, None)]:
        assert funcopt.ADOPT([p], clip_lambda=value).param_groups[0]["clip_lambda"] == stored
    assert funcopt.ADOPT([p]).param_groups[0]["clip_lambda"] == "step ** 0.25"
    assert default_clip_lambda(16) == oracle_default(16) == 2.0
    for bad in (lambda step: step ** 0.5, math.sqrt, "step ** 0.5", 0.25):
        with pytest.raises(ValueError, match=r"clip_lambda=.*not supported.*step \*\* 0.25.*None"):
            funcopt.ADOPT([p], clip_lambda=bad)
    opt = funcopt.ADOPT([p])
    opt.param_groups[0]["clip_lambda"] = lambda step: 1.0
    with pytest.raises(ValueError, match="clip_lambda"):
        opt.step([torch.ones(2)])
    assert "step" not in opt.param_groups[0]  # (added at the first step, as the oracle's)


@pytest.mark.parametrize("kw,msg", [
    (dict(lr=-1e-3), "learning rate must be positive"),
    (dict(betas=(1.0, 0.99)), r"beta1 must be in the range \[0.0, 1.0\)"),
    (dict(betas=(0.9, -0.1)), r"beta2 must be in the range \[0.0, 1.0\)"),
    (dict(weight_decay=-0.1), "weight_decay must be non-negative"),
    (dict(eps=-1.0), "eps must be non-negative"),
])
def test_invalid_hyperparameters(kw, msg):
    with pytest.raises(Exception, match=msg):
        po.ADOPT([torch.zeros(2, requires_grad=True)], **kw)
    with pytest.raises(ValueError, match=msg):
        funcopt.ADOPT([torch.zeros(2, requires_grad=True)], **kw)
    opt = funcopt.ADOPT([torch.zeros(2, requires_grad=True)])
    key, value = next(iter(kw.items()))
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=msg):
        opt.step([torch.ones(2)])


def test_defaults_and_signature_are_the_oracles():
    p = torch.zeros(2, requires_grad=True)
    ours = inspect.signature(funcopt.ADOPT.__init__).parameters
    theirs = inspect.signature(po.ADOPT.__init__).parameters
    positional = [n for n, x in theirs.items() if x.kind is x.POSITIONAL_OR_KEYWORD]
    assert [n for n, x in ours.items() if x.kind is x.POSITIONAL_OR_KEYWORD] == positional
    for n in positional:
        if n not in ("self", "params", "clip_lambda"):
            assert ours[n].default == theirs[n].default, n
    assert ours["impl"].kind is inspect.Parameter.KEYWORD_ONLY
    group = {k: v for k, v in funcopt.ADOPT([p]).state_dict()["param_groups"][0].items() if k != "step"}
    assert group == po.ADOPT([p]).state_dict()["param_groups"][0]


def test_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(adopt_module.ADOPT, "ADOPT", globs={}) if t.examples]
    assert tests
    for t in tests:
        runner.run(t)
    assert runner.failures == 0

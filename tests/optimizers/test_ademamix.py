"""AdEMAMix: ``funcopt.AdEMAMix`` against its oracle,
``pytorch_optimizer.AdEMAMix`` (pytorch-optimizer 4.1.0, a test dependency).

Bitwise (``torch.equal``) in float32 and float64, eager and scripted, over
>= 20 steps with ``None`` gradients, 0-d, empty and non-contiguous
parameters, every option (the default tier a covering set, the rest tier the
registry's whole grid), the ``alpha``/``beta3`` warm-up across its end
(``t_alpha_beta3`` < steps); float16/bfloat16 against the oracle's foreach
path (its divide-then-add form); a param group without gradients still
counts its steps; complex parameters and sparse gradients refused with
nothing changed; ``torch.compile`` (fullgraph) against eager within rtol
1e-5; state dicts moved both ways between the two classes, then both keep
stepping.  The oracle negates and decays ``p.grad`` in place: it gets clones.
"""
from __future__ import annotations

import copy
import doctest
import inspect

import pytest
import torch

import funcopt
from funcopt.optimizers import ademamix as ademamix_module
from funcopt.registry import REGISTRY

from _oracle_case import assert_same, make_grads, make_params, oracle_step, parity

po = pytest.importorskip("pytorch_optimizer")

STEPS = 22
SPEC = REGISTRY["AdEMAMix"]
SLOTS = ["exp_avg", "exp_avg_sq", "exp_avg_slow"]

CONFIGS = [
    dict(lr=0.01),
    dict(lr=0.01, t_alpha_beta3=10.0, alpha=0.5),
    dict(lr=0.02, betas=(0.5, 0.9, 0.99), weight_decay=0.1, maximize=True, t_alpha_beta3=7),
    dict(lr=0.01, weight_decay=0.1, weight_decouple=True, eps=1e-3),
    dict(lr=0.01, weight_decay=0.3, weight_decouple=True, fixed_decay=True, maximize=True, alpha=0.5),
]


_params, _grads, _oracle_step = make_params, make_grads, oracle_step


def _assert_same(fo, ref, fparams, rparams, exact=True):
    assert_same(fo, ref, fparams, rparams, SLOTS, exact)


def _parity(cfg, dtype, mode, steps=STEPS):
    parity(funcopt.AdEMAMix, po.AdEMAMix, SLOTS, cfg, dtype, mode, steps)


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
    defaults = inspect.signature(funcopt.AdEMAMix.__init__).parameters
    for key, values in SPEC.grid.items():
        for v in values:
            assert any((c[key] if key in c else defaults[key].default) == v for c in CONFIGS), (key, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    """float16/bfloat16: the oracle's foreach path (update / denominator, then
    added) -- its per-parameter path (``foreach=False``) rounds ``exp_avg_sq``
    otherwise; funcopt runs the foreach formula."""
    fp, rp = _params(dtype), _params(dtype)
    cfg = dict(lr=0.01, weight_decay=0.1, t_alpha_beta3=10.0)
    fo, ref = funcopt.AdEMAMix(fp, **cfg), po.AdEMAMix(rp, **cfg)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = _grads(fp, step, gen)
        fo.step(grads)
        _oracle_step(ref, rp, grads)
    _assert_same(fo, ref, fp, rp)


def test_group_without_gradients_counts_its_steps():
    """Every group's ``step`` moves on every step() (the oracle's rule), also
    a group none of whose parameters has a gradient: its bias corrections and
    warm-up then start from there."""
    def groups(params):
        return [dict(params=params[:2]), dict(params=params[2:], lr=0.05, t_alpha_beta3=6.0)]

    fp, rp = _params(torch.float32), _params(torch.float32)
    fo, ref = funcopt.AdEMAMix(groups(fp), lr=0.01), po.AdEMAMix(groups(rp), lr=0.01)
    gen = torch.Generator().manual_seed(2)
    for step in range(10):
        grads = _grads(fp, 6, gen)
        if step < 4:
            grads[2:] = [None] * (len(grads) - 2)
        fo.step(grads)
        _oracle_step(ref, rp, grads)
        assert [g["step"] for g in fo.param_groups] == [g["step"] for g in ref.param_groups] == [step + 1] * 2
    _assert_same(fo, ref, fp, rp)


@pytest.mark.parametrize("kind", ["complex", "sparse"])
def test_complex_and_sparse_refused(kind):
    p = torch.randn(4, 3, requires_grad=True)
    q = torch.randn(5, dtype=torch.complex64 if kind == "complex" else torch.float32, requires_grad=True)
    opt = funcopt.AdEMAMix([p, q], lr=0.1)
    opt.step([torch.randn(4, 3), None])  # q without a gradient: fine, as in the oracle
    before = (p.detach().clone(), q.detach().clone(), copy.deepcopy(opt.state_dict()))
    bad = torch.randn(5, dtype=q.dtype) if kind == "complex" else torch.randn(5).to_sparse()
    msg = "AdEMAMix does not support complex parameter" if kind == "complex" else \
        "AdEMAMix does not support sparse gradient"
    for scripted in (False, True):
        if scripted:
            funcopt.script(opt)
        with pytest.raises(RuntimeError, match=msg):
            opt.step([torch.randn(4, 3), bad])
        assert torch.equal(p, before[0]) and torch.equal(q, before[1])
        assert opt.param_groups[0].get("step", 0) == 1
        after = opt.state_dict()
        assert torch.equal(after["state"][0]["exp_avg"], before[2]["state"][0]["exp_avg"])
    ref = po.AdEMAMix([torch.randn(5, dtype=q.dtype, requires_grad=True)])
    ref.param_groups[0]["params"][0].grad = bad
    with pytest.raises(Exception, match=msg[len("AdEMAMix "):]):
        ref.step()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.rest)])
@pytest.mark.parametrize("cfg", [dict(lr=0.01, weight_decay=0.1, t_alpha_beta3=3.0, maximize=True),
                                 pytest.param(dict(lr=0.01, weight_decay=0.1, weight_decouple=True),
                                              marks=pytest.mark.rest)],
                         ids=["warmup", "plain"])
def test_compile_fullgraph(cfg, backend):
    """``torch.compile(fullgraph=True)`` of a function that steps (the bias
    corrections and warm-up as tensors from the group's counter), from the
    first step, with a ``None`` gradient, against eager funcopt (and eager
    against the oracle).  ``aot_eager`` traces like inductor (Dynamo,
    AOTAutograd) without building C++; inductor itself in the rest tier."""
    torch._dynamo.reset()
    try:
        pe, pc, rp = _params(torch.float32), _params(torch.float32), _params(torch.float32)
        eager, compiled_opt = funcopt.AdEMAMix(pe, **cfg), funcopt.AdEMAMix(pc, **cfg)
        ref = po.AdEMAMix(rp, **cfg)

        @torch.compile(fullgraph=True, backend=backend)
        def step(grads):
            compiled_opt.step(grads)

        gen = torch.Generator().manual_seed(1)
        for i in range(5):
            grads = _grads(pe, 9 if i == 2 else 6, gen)
            eager.step(grads)
            step(grads)
            _oracle_step(ref, rp, grads)
        _assert_same(eager, ref, pe, rp)
        _assert_same(compiled_opt, eager, pc, pe, exact=False)
        assert compiled_opt.param_groups[0].get("step", 0) == 5
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("direction", ["ours_to_oracle", "oracle_to_ours"])
@pytest.mark.parametrize("cfg", [dict(lr=0.01, weight_decay=0.1, maximize=True, t_alpha_beta3=10.0),
                                 dict(lr=0.01, weight_decouple=True, weight_decay=0.1, alpha=0.5)],
                         ids=["warmup", "plain"])
def test_state_dict_both_ways(cfg, direction):
    """Steps on one class, its state dict loaded into the other (fresh, same
    hyperparameters, the parameters copied), then both keep stepping from the
    same state (the warm-up too: it reads the loaded ``step``): bitwise equal
    to an uninterrupted oracle."""
    dtype = torch.float64
    gen = torch.Generator().manual_seed(1)
    plan = [_grads(_params(dtype), step, gen) for step in range(2 * 7)]
    first_cls, second_cls = ((funcopt.AdEMAMix, po.AdEMAMix) if direction == "ours_to_oracle"
                             else (po.AdEMAMix, funcopt.AdEMAMix))

    def stepper(opt, params):
        if isinstance(opt, funcopt.AdEMAMix):
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
    assert o2.param_groups[0].get("step", 0) == 7
    pr = _params(dtype)
    ref = po.AdEMAMix(pr, **cfg)
    for grads in plan:
        _oracle_step(ref, pr, grads)
    for grads in plan[7:]:
        stepper(o2, p2)(grads)
        stepper(o1, p1)(grads)
    ours, ours_p = (o2, p2) if second_cls is funcopt.AdEMAMix else (o1, p1)
    theirs, theirs_p = (o1, p1) if second_cls is funcopt.AdEMAMix else (o2, p2)
    _assert_same(ours, ref, ours_p, pr)
    _assert_same(ours, theirs, ours_p, theirs_p)


def test_state_dict_format_and_weights_only_load(tmp_path):
    """The oracle's param-group keys (``maximize`` left out where it is the
    constructor's, kept where a group has its own), ``t_alpha_beta3`` both ways,
    read back with ``torch.load(weights_only=True)``."""
    p, q = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    opt = funcopt.AdEMAMix([dict(params=[p]), dict(params=[q], maximize=True, t_alpha_beta3=5.0)], lr=0.1)
    opt.step([torch.randn(3), torch.randn(2)])
    ref = po.AdEMAMix([torch.randn(3, requires_grad=True)], lr=0.1)
    ref.param_groups[0]["params"][0].grad = torch.randn(3)
    ref.step()
    sd = opt.state_dict()
    assert set(sd["param_groups"][0]) == set(ref.state_dict()["param_groups"][0])
    assert sd["param_groups"][1]["maximize"] is True
    torch.save(sd, tmp_path / "ademamix.pt")
    fresh = funcopt.AdEMAMix([dict(params=[p.detach().clone().requires_grad_()]),
                              dict(params=[q.detach().clone().requires_grad_()])], lr=0.1)
    fresh.load_state_dict(torch.load(tmp_path / "ademamix.pt", weights_only=True))
    assert [g["maximize"] for g in fresh.param_groups] == [False, True]
    assert [g["t_alpha_beta3"] for g in fresh.param_groups] == [None, 5.0]
    mine = funcopt.AdEMAMix([torch.randn(3, requires_grad=True)], lr=0.1, maximize=True)
    mine.load_state_dict(ref.state_dict())
    assert mine.param_groups[0]["maximize"] is True and mine.param_groups[0].get("step", 0) == 1


@pytest.mark.parametrize("kw,msg", [
    (dict(lr=-1e-3), "learning rate must be positive"),
    (dict(betas=(1.0, 0.99, 0.9)), r"beta1 must be in the range \[0.0, 1.0\)"),
    (dict(betas=(0.9, 1.0, 0.9)), r"beta2 must be in the range \[0.0, 1.0\)"),
    (dict(betas=(0.9, 0.99, 1.5)), r"beta3 must be in the range \[0.0, 1.0\]"),
    (dict(weight_decay=-0.1), "weight_decay must be non-negative"),
    (dict(alpha=-1.0), "alpha must be non-negative"),
    (dict(t_alpha_beta3=-1.0), "t_alpha_beta3 must be non-negative"),
    (dict(eps=-1.0), "eps must be non-negative"),
])
def test_invalid_hyperparameters(kw, msg):
    with pytest.raises(Exception, match=msg):
        po.AdEMAMix([torch.zeros(2, requires_grad=True)], **kw)
    with pytest.raises(ValueError, match=msg):
        funcopt.AdEMAMix([torch.zeros(2, requires_grad=True)], **kw)


@pytest.mark.parametrize("kw,error,msg", [
    (dict(t_alpha_beta3=0.0), ZeroDivisionError, "t_alpha_beta3 must be positive"),
    (dict(t_alpha_beta3=5.0, betas=(0.0, 0.99, 0.9)), ValueError, "beta1 must be positive"),
    (dict(t_alpha_beta3=5.0, betas=(0.9, 0.99, 0.0)), ValueError, "beta3 must be positive"),
])
def test_refused_where_the_oracle_fails_at_the_first_step(kw, error, msg):
    """What the oracle takes at construction and then fails on (a division by
    zero, log(0)): refused up front, with the reason."""
    ref = po.AdEMAMix([torch.zeros(2, requires_grad=True)], **kw)
    ref.param_groups[0]["params"][0].grad = torch.ones(2)
    with pytest.raises(error):
        ref.step()
    with pytest.raises(ValueError, match=msg):
        funcopt.AdEMAMix([torch.zeros(2, requires_grad=True)], **kw)
    opt = funcopt.AdEMAMix([torch.zeros(2, requires_grad=True)], betas=kw.get("betas", (0.9, 0.999, 0.9999)))
    opt.param_groups[0]["t_alpha_beta3"] = kw["t_alpha_beta3"]
    with pytest.raises(ValueError, match=msg):
        opt.step([torch.ones(2)])
    assert opt.param_groups[0].get("step", 0) == 0


def test_defaults_and_signature_are_the_oracles():
    p = torch.zeros(2, requires_grad=True)
    ours = inspect.signature(funcopt.AdEMAMix.__init__).parameters
    theirs = inspect.signature(po.AdEMAMix.__init__).parameters
    positional = [n for n, x in theirs.items() if x.kind is x.POSITIONAL_OR_KEYWORD]
    assert [n for n, x in ours.items() if x.kind is x.POSITIONAL_OR_KEYWORD] == positional
    for n in positional[2:]:
        assert ours[n].default == theirs[n].default, n
    assert ours["impl"].kind is inspect.Parameter.KEYWORD_ONLY
    group = {k: v for k, v in funcopt.AdEMAMix([p]).state_dict()["param_groups"][0].items() if k != "step"}
    assert group == po.AdEMAMix([p]).state_dict()["param_groups"][0]


def test_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(ademamix_module.AdEMAMix, "AdEMAMix", globs={}) if t.examples]
    assert tests
    for t in tests:
        runner.run(t)
    assert runner.failures == 0

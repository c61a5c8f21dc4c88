"""The ``torch.optim.Optimizer`` surface as torch's own tests and frameworks use it.

Each behaviour is checked against ``torch.optim`` doing the same thing (the
oracle), for every registry algorithm, eager and scripted where it applies:
the live ``opt.state``, torch's hooks, ``param_groups`` edits, ``param_names``,
older checkpoints, ``copy.deepcopy`` / ``pickle``, a repeated parameter,
``fused=True`` on a device without fused kernels, and several threads using
one optimizer.
"""
from __future__ import annotations

import collections
import copy
import io
import pickle
import threading

import pytest
import torch

import funcopt
from funcopt.script import quiet_jit
from _oracles import oracle_form, without_instance_keys
from funcopt.registry import REGISTRY

ALGOS = list(REGISTRY)
MODES = ["eager", "scripted"]


def _make(spec, params, mode, **kw):
    opt = spec.cls(params, **dict(spec.base, **kw))
    return funcopt.script(opt) if mode == "scripted" else opt


def _pair(spec, mode, shapes=((3, 2), (4,)), seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    # shaped as torch's class takes them (spec.param_shape: Muon matrices only)
    shapes = tuple(spec.param_shape(s) for s in shapes)
    a = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    b = [p.detach().clone().requires_grad_() for p in a]
    kw = dict(spec.base, **kw)
    return _make(spec, a, mode, **kw), a, spec.torch_cls(b, **kw), b


def _grads(params, t):
    gen = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _step_both(f, fp, t, tp, t_idx):
    for ps, opt in ((fp, f), (tp, t)):
        for p, g in zip(ps, _grads(ps, t_idx)):
            p.grad = g
        opt.step()


def _assert_same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ live state
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALGOS)
def test_state_is_a_live_defaultdict_keyed_by_param(name, mode):
    spec = REGISTRY[name]
    kw = dict(spec.rich)
    f, fp, t, tp = _pair(spec, mode, **kw)
    for i in range(2):
        _step_both(f, fp, t, tp, i)
    assert isinstance(f.state, collections.defaultdict) and f.state is f.state
    assert set(map(id, f.state)) == set(map(id, fp))
    for p, q in zip(fp, tp):
        assert set(f.state[p]) == set(t.state[q])
        for k in t.state[q]:
            torch.testing.assert_close(*oracle_form(f.state[p][k], t.state[q][k]))
    # an in-place edit of a state tensor is seen by the next step (same tensors);
    # each parameter's own first slot (Adafactor keeps row_var/col_var for a
    # matrix, variance for a vector)
    slot0, slot1 = ([k for k in t.state[q] if k != "step"][0] for q in tp[:2])
    f.state[fp[0]][slot0].mul_(0.5)
    t.state[tp[0]][slot0].mul_(0.5)
    # a replaced entry value is checked and pushed into the core
    f.state[fp[1]][slot1] = f.state[fp[1]][slot1].clone().fill_(0.25)
    t.state[tp[1]][slot1] = t.state[tp[1]][slot1].clone().fill_(0.25)
    _step_both(f, fp, t, tp, 5)
    _assert_same(fp, tp)
    # deleting a parameter's state restarts it, as in torch (Adagrad: torch
    # fails at the next step with a KeyError; funcopt refuses clearly)
    del f.state[fp[0]]
    if spec.cls.init_at_construction:
        with pytest.raises(ValueError, match="cannot lose its state"):
            f.step()
        f.state[fp[0]] = {k: v.clone() for k, v in t.state[tp[0]].items()}
    else:
        del t.state[tp[0]]
    _step_both(f, fp, t, tp, 6)
    _assert_same(fp, tp)
    # keys that are not parameters are kept and land in state_dict()
    f.state["note"] = 1
    assert f.state_dict()["state"]["note"] == 1


@pytest.mark.parametrize("name", ALGOS)
def test_bad_state_written_through_opt_state_is_rejected_before_any_change(name):
    spec = REGISTRY[name]
    kw = dict(spec.rich)
    f, fp, t, tp = _pair(spec, "eager", **kw)
    _step_both(f, fp, t, tp, 0)
    before = [p.detach().clone() for p in fp]
    slot = [k for k in f.state[fp[0]] if k != "step"][0]
    f.state[fp[0]][slot] = torch.zeros(7)
    for p, g in zip(fp, _grads(fp, 1)):
        p.grad = g
    with pytest.raises(ValueError, match="shape"):
        f.step()
    for p, b in zip(fp, before):
        assert torch.equal(p.detach(), b)


# ------------------------------------------------------------------ hooks
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALGOS)
def test_hooks_run_as_in_torch(name, mode):
    spec = REGISTRY[name]
    calls = []
    shape = spec.param_shape((3,))  # as torch's class takes it (Muon: (3, 1))
    p = torch.randn(shape, requires_grad=True)
    opt = _make(spec, [p], mode)
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    h = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("tag", 7))

    def post(o, sd):
        sd["seen_tag"] = sd["state"].pop("tag", None)
        return sd

    opt.register_state_dict_post_hook(post)
    p.grad = torch.ones(shape)
    opt.step()
    h.remove()
    opt.step()
    assert calls == ["pre", "post", "pre"]
    sd = opt.state_dict()
    assert sd["seen_tag"] == 7 and "tag" not in sd["state"]
    del sd["seen_tag"]

    def pre_load(o, sd):
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.125
        return sd

    opt.register_load_state_dict_pre_hook(pre_load)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.125 and calls[-1] == "loaded"


# --------------------------------------------------------- param_groups edits
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALGOS)
def test_params_reassigned_through_param_groups_are_honoured(name, mode):
    spec = REGISTRY[name]
    f, fp, t, tp = _pair(spec, mode, shapes=((3,), (2,), (4,)))
    _step_both(f, fp, t, tp, 0)
    f.param_groups[0]["params"] = [fp[2], fp[0]]  # torch honours this: so must we
    t.param_groups[0]["params"] = [tp[2], tp[0]]
    t.state.pop(tp[1], None)  # torch's state_dict() fails on state of a dropped parameter; ours drops it
    fp, tp = [fp[2], fp[0]], [tp[2], tp[0]]
    for i in range(1, 3):
        _step_both(f, fp, t, tp, i)
    _assert_same(fp, tp)
    sf, st = f.state_dict(), t.state_dict()
    assert sf["param_groups"][0]["params"] == st["param_groups"][0]["params"]
    assert set(sf["state"]) == set(st["state"])


@pytest.mark.parametrize("name", ALGOS)
def test_state_dict_after_param_groups_extend_matches_torch(name):
    spec = REGISTRY[name]
    f, fp, t, tp = _pair(spec, "eager")
    _step_both(f, fp, t, tp, 0)
    f.param_groups.extend(f.param_groups)
    t.param_groups.extend(t.param_groups)
    sf, st = f.state_dict(), t.state_dict()
    assert [g["params"] for g in sf["param_groups"]] == [g["params"] for g in st["param_groups"]]
    assert set(sf["state"]) == set(st["state"])
    with pytest.raises(ValueError, match="more than once"):
        f.step()


@pytest.mark.parametrize("name", ALGOS)
def test_repeated_parameter_warns_like_torch_and_step_is_refused(name):
    spec = REGISTRY[name]
    p = torch.randn(spec.param_shape((2,)), requires_grad=True)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = spec.cls([p, p])
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="more than once"):
        opt.step()
    assert opt.state_dict()["param_groups"][0]["params"] == [0, 0]


# ----------------------------------------------- param_names, old checkpoints
@pytest.mark.parametrize("named_src,named_dst", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("name", ALGOS)
def test_param_names_kept_like_torch(name, named_src, named_dst):
    spec = REGISTRY[name]
    out = []
    for cls in (spec.cls, spec.torch_cls):
        model = torch.nn.Linear(3, 2)
        # the parameters torch's class takes (all of them; Muon: the weight only)
        named = [(n, p) for n, p in model.named_parameters() if spec.takes(tuple(p.shape), p.dtype)]
        plain = [p for _, p in named]
        src = cls(named if named_src else plain)
        dst = cls(named if named_dst else plain)
        dst.load_state_dict(copy.deepcopy(src.state_dict()))
        out.append(dst.state_dict()["param_groups"][0].get("param_names"))
    want = ["weight", "bias"] if spec.takes((2,)) else ["weight"]
    assert out[0] == out[1] == want


@pytest.mark.parametrize("name", ALGOS)
def test_older_checkpoint_without_newer_switches_loads(name):
    spec = REGISTRY[name]
    f, fp, t, tp = _pair(spec, "eager")
    _step_both(f, fp, t, tp, 0)
    old = copy.deepcopy(t.state_dict())
    for g in old["param_groups"]:
        for flag in ("maximize", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"):
            g.pop(flag, None)
    defaults = dict(t.defaults)  # before the load (torch's __setstate__ adds 'differentiable')
    f.load_state_dict(copy.deepcopy(old))
    t.load_state_dict(copy.deepcopy(old))
    # a switch torch's class does not restore on load (Adafactor: maximize;
    # its next step then fails with a KeyError) funcopt fills with the
    # constructor default; torch's group gets the same so that it can step
    unrestored = [k for k in defaults if k not in t.param_groups[0]]
    mine = without_instance_keys(spec, f.param_groups[0], t.param_groups[0])  # (an oracle's instance options)
    assert mine.keys() == t.param_groups[0].keys() | set(unrestored)
    for k in unrestored:
        assert f.param_groups[0][k] == defaults[k]
        t.param_groups[0][k] = defaults[k]
    _step_both(f, fp, t, tp, 1)
    _assert_same(fp, tp)
    # a group that lacks a real hyperparameter is another optimizer's: refused
    bad = copy.deepcopy(t.state_dict())
    del bad["param_groups"][0]["lr"]
    with pytest.raises(ValueError, match="lacks hyperparameters"):
        f.load_state_dict(bad)


# ------------------------------------------------------- copies and pickles
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALGOS)
def test_copy_and_pickle_keep_state_and_mode(name, mode, how):
    spec = REGISTRY[name]
    f, fp, t, tp = _pair(spec, mode)
    for i in range(2):
        _step_both(f, fp, t, tp, i)
    if how == "deepcopy":
        g = copy.deepcopy(f)
    else:
        buf = io.BytesIO()
        torch.save(f, buf)
        buf.seek(0)
        g = torch.load(buf, weights_only=False)
    assert {k for k in vars(g) if not k.startswith("_")} == {k for k in vars(f) if not k.startswith("_")}
    assert g._scripted == (mode == "scripted")
    gp = [p for grp in g.param_groups for p in grp["params"]]
    assert all(a is not b for a, b in zip(gp, fp))
    # the copy steps on, independently, exactly like the original would; the oracle's twin
    # from its state dict (pytorch_optimizer's classes lose their instance attributes --
    # clip_lambda, maximize -- in a deepcopy: torch.optim.Optimizer pickles only its dicts)
    hp = [p.detach().clone().requires_grad_() for grp in t.param_groups for p in grp["params"]]
    h = type(t)(hp, **dict(spec.base))
    h.load_state_dict(copy.deepcopy(t.state_dict()))
    _step_both(g, gp, h, hp, 2)
    _assert_same(gp, hp)
    # a weights_only load of the state dict works (plain containers)
    buf = io.BytesIO()
    torch.save(g.state_dict(), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    pickle.loads(pickle.dumps(g.state_dict()))


# ------------------------------------------------------ fused availability
@pytest.mark.parametrize("name", [n for n in ALGOS if "cpu" in REGISTRY[n].fused_devices])
def test_fused_on_meta_fails_at_step_like_torch_then_works_on_cpu(name):
    spec = REGISTRY[name]
    with torch.device("meta"):
        model = torch.nn.Linear(2, 3)
    opt = spec.cls(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()  # the optimizer's (meta) parameters have no gradient now: a no-op, as in torch


# ------------------------------------------------------------------ threads
@pytest.mark.parametrize("mode", MODES)
def test_two_threads_stepping_one_optimizer_lose_no_update(mode):
    """SGD, lr=1, gradient 1: after T threads x N steps every element is -T*N
    exactly; an unserialized step loses updates (or crashes)."""
    threads, steps, n = 4, 50, 1 << 20
    p = torch.zeros(n, requires_grad=True)
    opt = funcopt.SGD([p], lr=1.0, momentum=0.0)
    if mode == "scripted":
        funcopt.script(opt)
    g = [torch.ones(n)]
    errors = []

    def work():
        try:
            for _ in range(steps):
                opt.step(g)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors
    assert torch.equal(p.detach(), torch.full((n,), -float(threads * steps)))


@pytest.mark.parametrize("name", ALGOS)
def test_script_from_many_threads_leaves_one_consistent_optimizer(name):
    spec = REGISTRY[name]
    f, fp, t, tp = _pair(spec, "eager")
    _step_both(f, fp, t, tp, 0)
    barrier = threading.Barrier(4)
    errors = []

    def work():
        try:
            barrier.wait(timeout=60)
            funcopt.script(f)
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(4)]
    with quiet_jit():
        for th in ts:
            th.start()
        for th in ts:
            th.join(timeout=300)
    assert not errors and f._scripted
    assert set(f.state_dict()["state"]) == set(t.state_dict()["state"])
    _step_both(f, fp, t, tp, 1)
    _assert_same(fp, tp)

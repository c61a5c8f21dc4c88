"""State dicts move both ways between funcopt and torch.optim; param groups,
LR changes, LR schedulers and add_param_group behave as in torch.optim.

Everything iterates over ``funcopt.registry.REGISTRY``; ``torch.optim`` is the
oracle (same kernel => compared bitwise with ``torch.equal``).
"""
import copy
import inspect
import warnings

import pytest
import torch

import funcopt
from _oracles import groups_equal, oracle_form, other_lr, same_value
from funcopt.registry import REGISTRY

K = 5  # steps before and after a checkpoint
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------- helpers
def torch_accepts(spec, name):
    return name in inspect.signature(spec.torch_cls.__init__).parameters


def impl_supported(spec, impl):
    if impl == "fused":
        return torch_accepts(spec, "fused") and "cpu" in spec.fused_devices
    # foreach: also an algorithm torch implements one way only (Muon: no switch)
    return torch_accepts(spec, "foreach") or not torch_accepts(spec, "fused")


def flags(impl):
    """torch.optim's switches for an implementation (funcopt accepts the same)."""
    return {"fused": True} if impl == "fused" else {"foreach": True}


def pick_combos(spec):
    """The first grid point, and the one enabling every conditional state slot
    with the most non-default settings (amsgrad for Adam, momentum for SGD)."""
    combos = list(spec.combos())
    conds = [c for _, c in spec.cls.slots if c]

    def score(kw):
        return (all(bool(kw.get(c)) for c in conds), sum(bool(v) for v in kw.values()))

    rich = max(combos, key=score)
    return [combos[0]] if rich == combos[0] else [combos[0], rich]


CASES = [
    pytest.param(name, kw, id=f"{name}-c{i}")
    for name, spec in REGISTRY.items()
    for i, kw in enumerate(pick_combos(spec))
]
ALGOS = list(REGISTRY)
IMPLS = ["fused", "foreach"]
MODES = ["eager", "scripted"]


def need(spec, impl):
    if not impl_supported(spec, impl):
        pytest.skip(f"{spec.name}: torch.optim has no {impl} implementation on CPU")


def make_funcopt(spec, params, kw, impl, mode):
    opt = spec.cls(params, **kw, **spec.torch_flags(flags(impl)))
    return funcopt.script(opt) if mode == "scripted" else opt


def make_torch(spec, params, kw, impl):
    return spec.torch_cls(params, **kw, **spec.torch_flags(flags(impl)))


def all_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def do_step(opt, grads):
    """One step with the given gradients (``None`` = no gradient), either API."""
    params = all_params(opt)
    assert len(grads) == len(params)
    if isinstance(opt, funcopt.Optimizer):
        opt.step([None if g is None else g.clone() for g in grads])
    else:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()


def assert_params_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x.detach(), y.detach()), f"param {i} differs: {x} vs {y}"


def assert_state_equal(sa, sb):
    """Two ``state_dict()['state']`` dicts: same ids, keys, metadata, values."""
    assert sorted(sa) == sorted(sb)
    for pid in sa:
        ea, eb = sa[pid], sb[pid]
        assert sorted(ea) == sorted(eb), pid
        for k in ea:
            va, vb = oracle_form(ea[k], eb[k])
            assert isinstance(va, torch.Tensor) == isinstance(vb, torch.Tensor), (pid, k)
            if isinstance(va, torch.Tensor):
                assert (va.dtype, va.shape, va.device) == (vb.dtype, vb.shape, vb.device), (pid, k)
                assert torch.equal(va, vb), f"state[{pid}][{k!r}]: {va} vs {vb}"
            else:
                assert same_value(va, vb), (pid, k)  # (SOAP's lists of tensors, numbers)


def groups_no_params(sd):
    return [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]


def assert_same(fo, to):
    assert_params_equal(all_params(fo), all_params(to))
    sf, st = fo.state_dict(), to.state_dict()
    assert_state_equal(sf["state"], st["state"])
    assert groups_equal(sf["param_groups"], st["param_groups"]), (sf["param_groups"], st["param_groups"])


# ------------------------------------------------------- checkpoint moves
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,kw", CASES)
def test_funcopt_to_torch(name, kw, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    params = make_params()
    start = clone_params(params)
    fo = make_funcopt(spec, params, kw, impl, mode)
    for t in range(K):
        do_step(fo, make_grads(params, t))
    assert any(not torch.equal(a, b) for a, b in zip(params, start)), "training did not move the params"
    sd = copy.deepcopy(fo.state_dict())
    tparams = clone_params(params)
    to = make_torch(spec, tparams, kw, impl)
    to.load_state_dict(sd)
    assert_same(fo, to)
    for t in range(K, 2 * K):
        g = make_grads(params, t)
        do_step(fo, g)
        do_step(to, g)
    assert_same(fo, to)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,kw", CASES)
def test_torch_to_funcopt(name, kw, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    tparams = make_params()
    to = make_torch(spec, tparams, kw, impl)
    for t in range(K):
        do_step(to, make_grads(tparams, t))
    sd = copy.deepcopy(to.state_dict())
    params = clone_params(tparams)
    fo = make_funcopt(spec, params, kw, impl, mode)
    fo.load_state_dict(sd)
    assert_same(fo, to)
    for t in range(K, 2 * K):
        g = make_grads(params, t)
        do_step(fo, g)
        do_step(to, g)
    assert_same(fo, to)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,kw", CASES)
def test_round_trip_mid_training(name, kw, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    p_ref = make_params()
    p_a = clone_params(p_ref)
    ref = make_funcopt(spec, p_ref, kw, impl, mode)  # uninterrupted
    a = make_funcopt(spec, p_a, kw, impl, mode)
    for t in range(K):
        do_step(ref, make_grads(p_ref, t))
        do_step(a, make_grads(p_ref, t))
    sd = copy.deepcopy(a.state_dict())
    p_b = clone_params(p_a)
    b = make_funcopt(spec, p_b, kw, impl, mode)
    b.load_state_dict(sd)
    del a, sd
    for t in range(K, 2 * K):
        do_step(ref, make_grads(p_ref, t))
        do_step(b, make_grads(p_ref, t))
    assert_same(b, ref)


@pytest.mark.parametrize("impl", IMPLS + [None])
@pytest.mark.parametrize("name,kw", CASES)
def test_state_dict_format(name, kw, impl, make_params, make_grads, clone_params):
    """Same kwargs (incl. fused/foreach, or none) => same param_groups; same state layout."""
    spec = REGISTRY[name]
    extra = {}
    if impl is not None:
        need(spec, impl)
        extra = spec.torch_flags(flags(impl))
    params = make_params()
    tparams = clone_params(params)
    fo = spec.cls(params, **kw, **extra)
    to = spec.torch_cls(tparams, **kw, **extra)
    sf, st = fo.state_dict(), to.state_dict()
    assert set(sf) == set(st) == {"state", "param_groups"}
    assert groups_equal(sf["param_groups"], st["param_groups"]), (sf["param_groups"], st["param_groups"])
    assert sorted(sf["state"]) == sorted(st["state"])  # Adagrad: state from construction
    g = make_grads(params, 0)
    do_step(fo, g)
    do_step(to, g)
    sf, st = fo.state_dict(), to.state_dict()
    assert groups_equal(sf["param_groups"], st["param_groups"]), (sf["param_groups"], st["param_groups"])
    assert sorted(sf["state"]) == sorted(st["state"])
    for pid, entry in st["state"].items():
        assert list(sf["state"][pid]) == list(entry), pid  # same keys, same order
        for k, v in entry.items():
            mine = sf["state"][pid][k]
            if k == "step" and isinstance(v, int):  # prodigyopt's int step: funcopt keeps torch's 0-d tensor
                assert isinstance(mine, torch.Tensor) and mine.dim() == 0, (pid, k)
                continue
            assert type(mine) is type(v), (pid, k)
            if isinstance(v, torch.Tensor):
                assert (mine.dtype, mine.shape, mine.device) == (v.dtype, v.shape, v.device), (pid, k)


# -------------------------------------------------- param groups, schedulers
def rich(spec):
    return pick_combos(spec)[-1]


def two_groups(spec, params, kw):
    lr = kw.get("lr", 0.01)
    return [
        {"params": params[:2], "lr": lr if getattr(spec.cls, "one_lr", False) else lr * 2.0, "weight_decay": 0.0},
        {"params": params[2:], "lr": other_lr(spec, lr), "weight_decay": 0.05},
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_param_groups_different_hyper(name, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    tparams = clone_params(params)
    fo = make_funcopt(spec, two_groups(spec, params, kw), kw, impl, mode)
    to = make_torch(spec, two_groups(spec, tparams, kw), kw, impl)
    assert len(fo.param_groups) == 2
    for t in range(10):
        g = make_grads(params, t)
        do_step(fo, g)
        do_step(to, g)
    assert_same(fo, to)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_lr_changed_between_steps(name, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    tparams = clone_params(params)
    fo = make_funcopt(spec, two_groups(spec, params, kw), kw, impl, mode)
    to = make_torch(spec, two_groups(spec, tparams, kw), kw, impl)
    ref_params = clone_params(params)  # same run with a constant lr
    ref = make_funcopt(spec, two_groups(spec, ref_params, kw), kw, impl, mode)
    tref_params = clone_params(params)  # torch's run with a constant lr
    tref = make_torch(spec, two_groups(spec, tref_params, kw), kw, impl)
    for t in range(8):
        g = make_grads(params, t)
        do_step(fo, g)
        do_step(to, g)
        do_step(ref, g)
        do_step(tref, g)
        new_lr = 0.3 / (t + 1)
        fo.param_groups[0]["lr"] = new_lr
        to.param_groups[0]["lr"] = new_lr
        if getattr(spec.cls, "one_lr", False) and fo.param_groups[1]["lr"] != 0.0:  # Prodigy: one lr (or 0)
            fo.param_groups[1]["lr"] = to.param_groups[1]["lr"] = new_lr
    assert_same(fo, to)
    # the change matters exactly where it matters to torch (Rprop reads lr
    # only to start its step sizes: a later change has no effect there either)
    torch_moved = not all(torch.equal(a, b) for a, b in zip(tparams[:2], tref_params[:2]))
    ours_moved = not all(torch.equal(a, b) for a, b in zip(params[:2], ref_params[:2]))
    assert ours_moved == torch_moved, f"lr change: funcopt affected={ours_moved}, torch affected={torch_moved}"


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.7 * e)),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_lr_scheduler(name, impl, mode, sched, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    tparams = clone_params(params)
    fo = make_funcopt(spec, two_groups(spec, params, kw), kw, impl, mode)
    to = make_torch(spec, two_groups(spec, tparams, kw), kw, impl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s_fo, s_to = SCHEDULERS[sched](fo), SCHEDULERS[sched](to)
        lrs_fo, lrs_to = [], []
        for t in range(7):
            g = make_grads(params, t)
            do_step(fo, g)
            do_step(to, g)
            s_fo.step()
            s_to.step()
            lrs_fo.append(s_fo.get_last_lr())
            lrs_to.append(s_to.get_last_lr())
    sched_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    assert not sched_warnings, sched_warnings
    assert lrs_fo == lrs_to
    assert len({tuple(x) for x in lrs_fo}) > 1, "scheduler never changed lr"
    assert_same(fo, to)
    assert fo.state_dict()["param_groups"][0]["lr"] == lrs_to[-1][0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_add_param_group_mid_run(name, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    tparams = clone_params(params)
    fo = make_funcopt(spec, params[:2], kw, impl, mode)
    to = make_torch(spec, tparams[:2], kw, impl)
    for t in range(3):
        g = make_grads(params[:2], t)
        do_step(fo, g)
        do_step(to, g)
    lr = kw.get("lr", 0.01)  # (Prodigy: the same lr -- its groups differ only by lr=0, which steps nothing new)
    new = {"lr": lr if getattr(spec.cls, "one_lr", False) else lr * 0.5, "weight_decay": 0.02}
    fo.add_param_group(dict(new, params=params[2:]))
    to.add_param_group(dict(new, params=tparams[2:]))
    if spec.cls.has_modes:  # Schedule-Free's oracle adds the group in eval mode (funcopt: the current mode)
        to.train()
    assert_params_equal(params, tparams)
    sf, st = fo.state_dict(), to.state_dict()
    assert groups_equal(sf["param_groups"], st["param_groups"]), (sf["param_groups"], st["param_groups"])
    # existing state is carried over unchanged.  (torch.optim.Adagrad creates
    # state for added params lazily, funcopt eagerly: compare torch's ids only.)
    assert set(st["state"]) <= set(sf["state"])
    assert_state_equal({i: sf["state"][i] for i in st["state"]}, st["state"])
    for t in range(3, 7):
        g = make_grads(params, t)
        if t == 3:
            g[0] = None  # an old param without a gradient on the first step of the new group
        do_step(fo, g)
        do_step(to, g)
    assert_same(fo, to)
    assert not torch.equal(params[-1], make_params()[-1]), "new group was not stepped"

"""Contracts of every funcopt optimizer (iterating over ``REGISTRY``).

* bad inputs raise a clear error and change nothing (params and state are
  snapshotted before and compared bitwise after);
* construction errors are torch.optim's own (same type, same message);
* ``None`` gradients, ``grad_scale`` / ``found_inf``, ``step()`` /
  ``step(closure)`` behave like torch.optim;
* ``import funcopt`` is silent and scripts nothing;
* float64 parity with torch's for-loop implementation.
"""
import copy
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import funcopt
from _oracles import oracle_form, other_lr, same_value
from funcopt.registry import REGISTRY

ALGOS = list(REGISTRY)
IMPLS = ["fused", "foreach"]
MODES = ["eager", "scripted"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------- helpers
def torch_accepts(spec, name):
    return name in inspect.signature(spec.torch_cls.__init__).parameters


def need(spec, impl):
    # foreach: also an algorithm torch implements one way only (Muon: no
    # foreach switch; funcopt's formula is torch's, per tensor)
    ok = (impl != "fused" or (torch_accepts(spec, impl) and "cpu" in spec.fused_devices)) and (
        impl != "foreach" or torch_accepts(spec, impl) or not torch_accepts(spec, "fused"))
    if not ok:
        pytest.skip(f"{spec.name}: no {impl} implementation on CPU")


def flags(impl, spec=None):
    out = {"fused": True} if impl == "fused" else {"foreach": True}
    return out if spec is None else spec.torch_flags(out)


def rich(spec):
    """A grid point enabling every conditional state slot (amsgrad, momentum...)."""
    conds = [c for _, c in spec.cls.slots if c]
    combos = list(spec.combos())
    return max(combos, key=lambda kw: (all(bool(kw.get(c)) for c in conds), sum(bool(v) for v in kw.values())))


def make(spec, params, kw, impl, mode):
    opt = spec.cls(params, **kw, **flags(impl, spec))
    return funcopt.script(opt) if mode == "scripted" else opt


def all_params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def snapshot(opt):
    """Deep copy of everything observable: params, state tensors, param_groups."""
    sd = opt.state_dict()
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in e.items()}
             for i, e in sd["state"].items()}
    groups = [{k: copy.deepcopy(v) for k, v in g.items()} for g in sd["param_groups"]]
    return {"params": [p.detach().clone() for p in all_params(opt)], "state": state, "groups": groups}


def assert_unchanged(before, opt):
    after = snapshot(opt)
    assert len(before["params"]) == len(after["params"])
    for i, (a, b) in enumerate(zip(before["params"], after["params"])):
        assert torch.equal(a, b), f"param {i} changed"
    assert after["groups"] == before["groups"], "param_groups changed"
    assert sorted(after["state"]) == sorted(before["state"]), "state ids changed"
    for i, entry in before["state"].items():
        assert sorted(entry) == sorted(after["state"][i]), f"state[{i}] keys changed"
        for k, v in entry.items():
            w = after["state"][i][k]
            assert same_value(v, w), f"state[{i}][{k!r}] changed"


def assert_params_equal(a, b, **tol):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = x.detach(), y.detach()
        if tol:
            torch.testing.assert_close(x, y, **tol, msg=lambda m: f"param {i}: {m}")
        else:
            assert torch.equal(x, y), f"param {i}: {x} vs {y}"


def assert_state_equal(sa, sb, **tol):
    assert sorted(sa) == sorted(sb)
    for i in sa:
        assert sorted(sa[i]) == sorted(sb[i]), i
        for k in sa[i]:
            x, y = oracle_form(sa[i][k], sb[i][k])
            if tol and isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, **tol, msg=lambda m: f"state[{i}][{k!r}]: {m}")
            else:
                assert same_value(x, y), f"state[{i}][{k!r}]: {x} vs {y}"


def torch_step(opt, grads):
    for p, g in zip(all_params(opt), grads):
        p.grad = None if g is None else g.clone()
    opt.step()


def two_group_opt(spec, make_params, make_grads, impl, mode, warm=2):
    """A two-group optimizer with state from ``warm`` steps."""
    params = make_params()
    kw = rich(spec)
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": other_lr(spec, kw.get("lr", 0.01))}]
    opt = make(spec, groups, kw, impl, mode)
    for t in range(warm):
        opt.step(make_grads(params, t))
    return opt, params


# ------------------------------------------------------------ bad gradients
def _bad_count(params, grads):
    return grads[:-1]


def _bad_shape(params, grads):
    grads[-1] = torch.zeros(tuple(params[-1].shape) + (2,), dtype=params[-1].dtype)
    return grads


def _bad_dtype(params, grads):
    grads[-1] = grads[-1].to(torch.float64)
    return grads


def _bad_sparse(params, grads):
    grads[-1] = grads[-1].to_sparse()
    return grads


def _bad_device(params, grads):
    grads[-1] = torch.empty(params[-1].shape, dtype=params[-1].dtype, device="meta")
    return grads


BAD_GRADS = {
    "count": (_bad_count, r"gradients for", ValueError),
    "shape": (_bad_shape, r"shape", ValueError),
    "dtype": (_bad_dtype, r"dtype", ValueError),
    # rich() turns weight decay on: every algorithm refuses a sparse gradient
    # then, with torch's RuntimeError (SGD/Adagrad take them without weight
    # decay: tests/test_complex_sparse.py)
    "sparse": (_bad_sparse, r"sparse", RuntimeError),
    "device": (_bad_device, r"meta", ValueError),
}


@pytest.mark.parametrize("kind", list(BAD_GRADS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_bad_grads_raise_and_change_nothing(name, impl, mode, kind, make_params, make_grads):
    spec = REGISTRY[name]
    need(spec, impl)
    opt, params = two_group_opt(spec, make_params, make_grads, impl, mode)
    corrupt, pattern, error = BAD_GRADS[kind]
    grads = corrupt(params, make_grads(params, 7))  # the bad one is the last: all others valid
    if kind == "device":
        try:
            grads[-1] + 0
        except Exception:  # pragma: no cover - meta tensors exist in torch 2.13
            pytest.skip("needs a second device (CUDA)")
    before = snapshot(opt)
    if kind == "sparse" and spec.cls.sparse_msg == "":
        assert rich(spec).get("weight_decay"), "the sparse case relies on weight decay"
    with pytest.raises(error, match=pattern):
        opt.step(grads)
    assert_unchanged(before, opt)
    opt.step(make_grads(params, 8))  # still usable
    assert not torch.equal(params[0], before["params"][0])


# -------------------------------------------- construction: torch's errors
_BAD_HYPER = [
    ("lr<0", {"lr": -1.0}),
    ("lr=nan", {"lr": float("nan")}),
    ("eps<0", {"eps": -1e-8}),
    ("weight_decay<0", {"weight_decay": -0.1}),
    ("beta0=1", {"betas": (1.0, 0.999)}),
    ("beta=1", {"beta": 1.0}),
    ("beta1=1", {"betas": (0.9, 1.0)}),
    ("beta0<0", {"betas": (-0.1, 0.999)}),
    ("momentum<0", {"momentum": -0.5}),
    ("nesterov-no-momentum", {"nesterov": True, "momentum": 0.0}),
    ("nesterov-dampening", {"nesterov": True, "momentum": 0.9, "dampening": 0.5}),
    ("lr_decay<0", {"lr_decay": -0.1}),
    ("initial_accumulator_value<0", {"initial_accumulator_value": -0.1}),
    ("fused+foreach", {"fused": True, "foreach": True}),
]


def _torch_error(spec, kw, params=None):
    try:
        spec.torch_cls([torch.zeros(spec.param_shape((2,)), requires_grad=True)] if params is None else params, **kw)
    except Exception as e:  # noqa: BLE001 - any of torch's errors is the oracle
        return e
    return None


HYPER_CASES = [
    pytest.param(name, kw, id=f"{name}-{label}")
    for name, spec in REGISTRY.items()
    for label, kw in _BAD_HYPER
    if all(torch_accepts(spec, k) for k in kw) and _torch_error(spec, kw) is not None
]


@pytest.mark.parametrize("name,kw", HYPER_CASES)
def test_invalid_hyperparameters_like_torch(name, kw):
    spec = REGISTRY[name]
    expected = _torch_error(spec, kw)
    with pytest.raises(type(expected)) as e:
        spec.cls([torch.zeros(2, requires_grad=True)], **kw)
    # torch's words, then the key and value that caused them; or, for a value of the wrong
    # type or length (Adafactor's eps=-1e-8: torch's "'float' object is not subscriptable"),
    # funcopt's own words (funcopt/_hyper.py), the same error type
    msg = str(e.value)
    assert msg.startswith(str(expected)) or msg.startswith(f"{spec.cls.__name__}: "), (msg, str(expected))
    assert any(f"{k}={v!r}" in msg for k, v in kw.items()), msg


def _refuses_nothing(spec):
    """An oracle outside torch that refuses (almost) none of the bad values of its own options
    (schedulefree's AdamWScheduleFree checks no range: funcopt takes what it takes, NaN aside)."""
    return spec.oracle_package is not None and sum(1 for c in HYPER_CASES if c.values[0] == spec.name) < 2


@pytest.mark.parametrize("name", ALGOS)
def test_every_algorithm_has_invalid_hyper_cases(name):
    """Every algorithm refuses some values here -- except one whose oracle refuses none."""
    spec = REGISTRY[name]
    if _refuses_nothing(spec):
        return
    assert sum(1 for c in HYPER_CASES if c.values[0] == name) >= 2


@pytest.mark.parametrize("name", ALGOS)
def test_empty_param_list_like_torch(name):
    spec = REGISTRY[name]
    expected = _torch_error(spec, {}, params=[])
    assert expected is not None
    with pytest.raises(type(expected)) as e:
        spec.cls([])
    assert str(e.value) == str(expected)


@pytest.mark.parametrize("name", ALGOS)
def test_funcopt_only_construction_errors(name):
    spec = REGISTRY[name]
    shape = spec.param_shape((2,))
    p = [torch.zeros(shape, requires_grad=True)]
    with pytest.raises(ValueError, match="impl"):
        spec.cls(p, impl="turbo")
    if torch_accepts(spec, "foreach"):
        with pytest.raises(ValueError, match="foreach"):
            spec.cls(p, impl="fused", foreach=True)
    if torch_accepts(spec, "fused"):
        with pytest.raises(ValueError, match="fused"):
            spec.cls(p, impl="foreach", fused=True)
    if torch_accepts(spec, "differentiable"):
        # differentiable steps are eager only: scripting one is refused, nothing changes
        opt = spec.cls(p, differentiable=True)
        with pytest.raises(ValueError, match="differentiable"):
            funcopt.script(opt)
        assert not opt._scripted
    opt = spec.cls(p)
    for _ in range(2):  # (ADOPT's first step only fills its second moment, as its oracle's)
        opt.step([torch.ones(shape)])
    assert not torch.equal(p[0], torch.zeros(shape))


# ----------------------------------- invalid hyperparameters between steps
SINGLE_KEY_BAD = [(label, kw) for label, kw in _BAD_HYPER if len(kw) == 1 and "fused" not in kw]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALGOS)
def test_invalid_hyper_via_param_groups(name, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    impl = "fused" if torch_accepts(spec, "fused") else "foreach"
    opt, params = two_group_opt(spec, make_params, make_grads, impl, mode)
    twin, twin_params = two_group_opt(spec, make_params, make_grads, impl, mode)
    tried = 0
    for label, kw in SINGLE_KEY_BAD:
        (key, bad), = kw.items()
        if key not in opt.param_groups[1] or isinstance(opt.param_groups[1][key], tuple) != isinstance(bad, tuple):
            continue  # a value of another type (a float for Adafactor's eps pair) is not a bad value of it
        expected = _torch_error(spec, kw)
        if expected is None:
            continue
        tried += 1
        good = opt.param_groups[1][key]
        opt.param_groups[1][key] = bad
        before_params = [p.detach().clone() for p in params]
        with pytest.raises(ValueError) as e:
            opt.step(make_grads(params, 5))
        assert str(expected) in str(e.value), label
        for a, b in zip(before_params, params):
            assert torch.equal(a, b), f"{label}: params changed"
        opt.param_groups[1][key] = good
    # (an oracle outside torch that refuses no value -- AdamWScheduleFree -- gives nothing to try:
    # test_every_algorithm_has_invalid_hyper_cases says which)
    assert tried >= 2 or _refuses_nothing(spec)
    before = snapshot(twin)
    assert_state_equal(snapshot(opt)["state"], before["state"])
    # nothing leaked: continuing matches a twin that never saw the bad values
    for t in range(5, 8):
        opt.step(make_grads(params, t))
        twin.step(make_grads(twin_params, t))
    assert_params_equal(params, twin_params)
    assert_state_equal(opt.state_dict()["state"], twin.state_dict()["state"])


# Run in a subprocess: a crash (segfault) must fail this test, not the session.
_TOGGLE_CHILD = r"""
import sys, torch, funcopt
from funcopt.registry import REGISTRY
def grads(t):
    g = torch.Generator().manual_seed(t)
    return [torch.randn(3, generator=g), torch.randn(2, 2, generator=g)]

def state_copy(opt):
    return {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}

def run(is_torch, impl):
    params = [torch.ones(3, requires_grad=True), torch.full((2, 2), 0.5, requires_grad=True)]
    opt = (spec.torch_cls if is_torch else spec.cls)(params, **kw, **{impl: True})
    def step(t):
        if is_torch:
            for p, g in zip(params, grads(t)):
                p.grad = g
            opt.step()
        else:
            opt.step(grads(t))
    step(0)
    before = ([p.detach().clone() for p in params], state_copy(opt))
    opt.param_groups[0][cond] = on
    try:
        step(1)
        step(2)
    except Exception as e:
        opt.param_groups[0][cond] = kw.get(cond)  # so state_dict() reads back
        after = ([p.detach().clone() for p in params], state_copy(opt))
        return ("raised", type(e).__name__, str(e)[:200], before, after)
    return ("ok", [p.detach().clone() for p in params], opt.state_dict()["state"])

def check(impl):
    ref, got = run(True, impl), run(False, impl)
    if got[0] == "raised":
        (p0, s0), (p1, s1) = got[3], got[4]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1)), "the failed step changed the params"
        assert sorted(s0) == sorted(s1) and all(
            torch.equal(s0[i][k], s1[i][k]) for i in s0 for k in s0[i]), "the failed step changed the state"
    if ref[0] == "ok":
        assert got[0] == "ok", f"torch accepts {cond}={on} mid-run; funcopt raised {got[1]}: {got[2]}"
        for a, b in zip(ref[1], got[1]):
            assert torch.equal(a, b), f"params differ from torch: {a} vs {b}"
        assert sorted(ref[2]) == sorted(got[2])
        for i in ref[2]:
            for k in ref[2][i]:
                assert torch.equal(ref[2][i][k], got[2][i][k]), (i, k)
    else:
        assert got[0] == "raised", f"torch raises {ref[1]} when {cond} is switched on mid-run; funcopt did not"
        assert got[1] in ("ValueError", ref[1]), f"funcopt raised {got[1]}: {got[2]}"

for case in sys.argv[1:]:  # "name:cond:impl"; fused (crash-prone) cases come last
    name, cond, impl = case.split(":")
    spec = REGISTRY[name]
    combos = list(spec.combos())
    kw = next(c for c in combos if not c.get(cond))
    on = next(c for c in combos if c.get(cond))[cond]
    try:
        check(impl)
        print(f"{case}: OK", flush=True)
    except AssertionError as e:
        print(f"{case}: FAIL {e}", flush=True)
"""

TOGGLE_CASES = [
    f"{name}:{cond}:{impl}"
    for impl in ("foreach", "fused")
    for name, spec in REGISTRY.items()
    for _, cond in spec.cls.slots
    if cond and torch_accepts(spec, impl)
    and any(c.get(cond) for c in spec.combos()) and any(not c.get(cond) for c in spec.combos())
]


def test_enable_state_flag_mid_run():
    """Switching on a flag that owns a state slot (SGD momentum, Adam amsgrad)
    between steps: torch's result, or a clear error that changes nothing.
    All cases in one child process (a crash must not take the session down);
    fused cases run last, so a crash there still reports the others."""
    assert TOGGLE_CASES
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _TOGGLE_CHILD, *TOGGLE_CASES],
                       capture_output=True, text=True, env=env, timeout=300)
    verdicts = [line for line in r.stdout.splitlines() if line.strip()]
    done = {v.split(": ", 1)[0] for v in verdicts}
    missing = [c for c in TOGGLE_CASES if c not in done]
    bad = [v for v in verdicts if not v.endswith(": OK")]
    assert r.returncode == 0 and not bad and not missing, (
        f"failed: {bad}; not reached: {missing}; child exit code {r.returncode} "
        f"(negative = killed by signal)\n{r.stderr[-2000:]}")


# ---------------------------------------------------- corrupt state dicts
def _last_tensor_slot(entry):
    return next(k for k in reversed(list(entry))
                if k != "step" and isinstance(entry[k], torch.Tensor) and entry[k].dim() > 0)


def _other_class_sd(spec):
    """A state dict of another registered algorithm with different group keys."""
    mine = set(spec.cls([torch.zeros(spec.probe_shape, requires_grad=True)]).param_groups[0])
    for other in REGISTRY.values():
        ogroup = other.torch_cls([torch.zeros(other.probe_shape, requires_grad=True)]).param_groups[0]
        if other.torch_cls is not spec.torch_cls and set(ogroup) != mine:
            return other
    return None


def _corrupt(kind, sd, spec, params):
    st = sd["state"]
    last = max(st)
    entry = st[last]
    if kind == "not a dict":
        return [sd["state"], sd["param_groups"]]
    if kind == "state not a dict":
        sd["state"] = list(st.values())
    elif kind == "group count":
        sd["param_groups"] = sd["param_groups"][:1]
    elif kind == "group size":
        sd["param_groups"][-1]["params"] = sd["param_groups"][-1]["params"][:-1]
    elif kind == "duplicate id":
        sd["param_groups"][-1]["params"][-1] = sd["param_groups"][0]["params"][0]
    elif kind == "missing state key":
        del entry[_last_tensor_slot(entry)]
    elif kind == "extra state key":
        entry["bogus"] = torch.zeros(1)
    elif kind == "wrong shape":
        k = _last_tensor_slot(entry)
        entry[k] = torch.zeros(tuple(entry[k].shape) + (2,))
    elif kind == "non-floating":
        k = _last_tensor_slot(entry)
        entry[k] = torch.zeros(entry[k].shape, dtype=torch.int64)
    elif kind == "bad step":
        entry["step"] = torch.zeros(3)
    elif kind == "unknown id":
        st[1000] = copy.deepcopy(entry)
    elif kind == "invalid hyperparameter":
        sd["param_groups"][-1]["lr"] = -1.0
    elif kind == "other optimizer":
        other = _other_class_sd(spec)
        assert other is not None, f"no registered algorithm with a different state format than {spec.name}"
        oparams = [p.detach().clone().requires_grad_() for p in params]
        kw = rich(other)
        o = other.torch_cls([{"params": oparams[:2]}, {"params": oparams[2:]}], **kw)
        for p in oparams:
            p.grad = torch.ones_like(p)
        o.step()
        return copy.deepcopy(o.state_dict())
    else:  # pragma: no cover
        raise AssertionError(kind)
    return sd


CORRUPT = {
    "not a dict": r"dict",
    "state not a dict": r"state",
    "group count": r"param groups",
    "group size": r"params",
    "duplicate id": r"twice|duplicate",
    "missing state key": r"keys",
    "extra state key": r"keys|bogus",
    "wrong shape": r"shape",
    "non-floating": r"dtype|float",
    "bad step": r"step",
    "unknown id": r"unknown|1000",
    # torch's two wordings, and pytorch_optimizer's (the oracle of ADOPT, AdEMAMix, SOAP)
    "invalid hyperparameter": r"Invalid learning rate|Learning rate should be >= 0|learning rate must be positive",
    "other optimizer": r"hyperparameters|differ",
}


def _oracle_accepts_lr(spec, lr):
    """Whether the oracle's constructor takes ``lr`` (its verdict is funcopt's, on load too)."""
    try:
        spec.torch_cls([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    except Exception:  # pytorch_optimizer's NegativeLRError is no ValueError
        return False
    return True


def _corrupt_cases():
    for name in ALGOS:
        has_step = any(slot == "step" for slot, _ in REGISTRY[name].cls.slots)
        for kind in CORRUPT:
            if kind == "bad step" and not has_step:  # SGD keeps no step counter to corrupt
                continue
            if kind == "missing state key" and len(REGISTRY[name].cls.slots) == 1:
                continue  # SGD: an entry without its one slot is empty, torch's valid "no state yet"
            if kind == "invalid hyperparameter" and _oracle_accepts_lr(REGISTRY[name], -1.0):
                continue  # schedulefree's AdamWScheduleFree steps with lr=-1: funcopt too (parity)
            yield name, kind


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,kind", list(_corrupt_cases()))
def test_load_corrupt_state_dict(name, mode, kind, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    impl = "fused" if torch_accepts(spec, "fused") else "foreach"
    opt, params = two_group_opt(spec, make_params, make_grads, impl, mode, warm=2)
    # a valid state dict from a different run, so that any partial load would show
    src, _ = two_group_opt(spec, make_params, lambda p, t: make_grads(p, t + 50), impl, "eager", warm=3)
    sd = _corrupt(kind, copy.deepcopy(src.state_dict()), spec, params)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=CORRUPT[kind]):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)


# ----------------------------------------------------------- None grads
NONE_PATTERN = [  # which params get a gradient at each step; p3 never does
    [1, 0, 1, 0],
    [1, 1, 1, 0],
    [0, 1, 0, 0],
    [1, 1, 1, 0],
]


def _torch_none_run(spec, params, kw, torch_flags, clone_params, make_grads):
    """torch.optim's params and state after each step of NONE_PATTERN."""
    tparams = clone_params(params)
    to = spec.torch_cls(tparams, **kw, **torch_flags)
    out = []
    for t, mask in enumerate(NONE_PATTERN):
        torch_step(to, [g if m else None for g, m in zip(make_grads(params, t), mask)])
        out.append(([p.detach().clone() for p in tparams], copy.deepcopy(to.state_dict()["state"])))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_none_grads_like_torch(name, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    tol = {}
    try:
        ref = _torch_none_run(spec, params, kw, flags(impl, spec), clone_params, make_grads)
    except TypeError:
        # torch 2.13's fused SGD cannot step a momentum param on its first
        # gradient while others already have buffers (None in its buffer
        # list); fall back to torch's foreach path: another kernel, so close.
        ref = _torch_none_run(spec, params, kw, flags("foreach"), clone_params, make_grads)
        tol = dict(rtol=1e-6, atol=1e-7)
    fo = make(spec, params, kw, impl, mode)
    for t, mask in enumerate(NONE_PATTERN):
        fo.step([g if m else None for g, m in zip(make_grads(params, t), mask)])
        assert_params_equal(params, ref[t][0], **tol)
        assert_state_equal(fo.state_dict()["state"], ref[t][1], **tol)
    assert torch.equal(params[3], make_params()[3]), "param without gradients moved"


# ----------------------------------------------------- grad_scale/found_inf
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_found_inf_skips_step(name, impl, mode, make_params, make_grads):
    spec = REGISTRY[name]
    need(spec, impl)
    opt, params = two_group_opt(spec, make_params, make_grads, impl, mode, warm=2)
    before = snapshot(opt)
    grads = make_grads(params, 9)
    grads[0] = torch.full_like(grads[0], float("inf"))
    opt.step(grads, grad_scale=torch.tensor(4.0), found_inf=torch.tensor(1.0))
    assert_unchanged(before, opt)
    opt.step(grads, found_inf=torch.tensor(1.0))
    assert_unchanged(before, opt)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_found_inf_on_first_step_is_a_no_op(name, impl, mode, make_params, make_grads, clone_params):
    """A skipped first step leaves the optimizer as if it had never stepped
    (every grid point: e.g. SGD's first-step momentum rule with dampening)."""
    spec = REGISTRY[name]
    need(spec, impl)
    # every grid point eagerly; scripted (compiles per optimizer) on one
    for kw in (spec.combos() if mode == "eager" else [rich(spec)]):
        params = make_params(shapes=[(3, 4), ()])
        twin_params = clone_params(params)
        opt = make(spec, params, kw, impl, mode)
        twin = make(spec, twin_params, kw, impl, mode)
        bad = [torch.full_like(g, float("nan")) for g in make_grads(params, 0)]
        opt.step(bad, found_inf=torch.tensor(1.0))
        try:
            assert_params_equal(params, twin_params)
            for t in range(1, 4):
                opt.step(make_grads(params, t))
                twin.step(make_grads(params, t))
            assert_params_equal(params, twin_params)
            assert_state_equal(opt.state_dict()["state"], twin.state_dict()["state"])
        except AssertionError as e:
            raise AssertionError(f"{name} {kw}: {e}") from None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_grad_scale_matches_unscaled_twin(name, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    twin_params = clone_params(params)
    opt = make(spec, params, kw, impl, mode)
    twin = make(spec, twin_params, kw, impl, mode)
    scale = torch.tensor(1000.0)
    for t in range(4):
        g = make_grads(params, t)
        opt.step([x * scale for x in g], grad_scale=scale, found_inf=torch.tensor(0.0))
        twin.step(g)
    # x * 1000 / 1000 is not always x in float32: close, not equal
    tol = dict(rtol=1e-6, atol=1e-6)
    assert_params_equal(params, twin_params, **tol)
    assert_state_equal(opt.state_dict()["state"], twin.state_dict()["state"], **tol)
    assert not torch.equal(params[0], make_params()[0])


# ------------------------------------------------------------ import, API
def test_import_is_silent_and_scripts_nothing():
    code = textwrap.dedent("""
        import torch, torch.jit
        calls = []
        real = torch.jit.script
        def spy(*a, **k):
            calls.append(repr(a[0])[:80])
            return real(*a, **k)
        torch.jit.script = spy
        import funcopt
        import funcopt.registry
        import funcopt.optimizers.sgd, funcopt.optimizers.adam, funcopt.optimizers.adagrad
        if calls:
            print("scripted at import:", calls)
        for spec in funcopt.REGISTRY.values():
            shape = spec.param_shape((2,))  # matrices only for Muon
            spec.cls([torch.zeros(shape, requires_grad=True)]).step([torch.ones(shape)])
        if calls:
            print("scripted by an eager step:", calls)
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == "" and r.stderr == "", (r.stdout, r.stderr[-3000:])



def test_import_leaves_dtensor_and_dcp_to_their_users():
    """``import funcopt`` / ``funcopt.distributed`` / ``funcopt.cli`` pull in neither DTensor
    nor torch.distributed.checkpoint (about a second per process, paid by every spawned rank
    and CLI command).  The modules are imported by whoever makes a DTensor or the first
    save/load, and funcopt still detects DTensor parameters then (test_fsdp2_dcp).  (torch
    itself imports them with torch._dynamo on the first ``torch.optim`` construction, which
    funcopt's first hyperparameter verdict makes: not asserted here.)"""
    code = textwrap.dedent("""
        import sys, torch
        import funcopt, funcopt.distributed, funcopt.cli
        from funcopt.distributed import ZeroRedundancyOptimizer, Checkpointer
        p = torch.zeros(3, requires_grad=True)
        print(sorted(m for m in ("torch.distributed.tensor", "torch.distributed.checkpoint",
                                 "torch.distributed.fsdp") if m in sys.modules))
        import torch.distributed.tensor as dt
        from funcopt import _dtensor
        print(_dtensor.is_dtensor(p), dt.DTensor.__name__)
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["[]", "False DTensor"], r.stdout

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_step_reads_p_grad_and_closure_returns_loss(name, impl, mode, make_params, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    kw = rich(spec)
    params = make_params()
    tparams = clone_params(params)
    fo = make(spec, params, kw, impl, mode)
    to = spec.torch_cls(tparams, **kw, **flags(impl, spec))
    for t in range(3):  # drop-in: step() reads p.grad
        for p, q in zip(params, tparams):
            p.grad = torch.full_like(p, 0.1 * (t + 1)) + p.detach()
            q.grad = p.grad.clone()
        assert fo.step() is None
        to.step()
    assert_params_equal(params, tparams)
    losses = {}

    def closure_for(ps, key):
        def closure():
            for p in ps:
                p.grad = None
            loss = sum((p * p).sum() for p in ps)
            loss.backward()
            losses[key] = loss
            return loss
        return closure

    for t in range(2):
        got = fo.step(closure_for(params, "fo"))
        ref = to.step(closure_for(tparams, "to"))
        assert got is losses["fo"]
        assert torch.equal(got.detach(), ref.detach())
    assert_params_equal(params, tparams)
    assert_state_equal(fo.state_dict()["state"], to.state_dict()["state"])


# --------------------------------------- parity with torch's for-loop, fp64
# Tolerance: rtol=1e-12, atol=1e-14 in float64.  The for-loop reference
# (foreach=False, fused=False) is a different kernel from funcopt's fused /
# foreach paths, so results differ by rounding (a few ulps per step), not
# bitwise; 20 steps keep that far below 1e-12 relative.
PARITY_TOL = dict(rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
# torch's classes only: an oracle outside torch has one implementation, which
# test_parity.py compares bitwise over the same grid
@pytest.mark.parametrize("name", [n for n in ALGOS if REGISTRY[n].oracle_package is None])
def test_parity_with_torch_for_loop_float64(name, impl, mode, make_params, make_grads, clone_params):
    spec = REGISTRY[name]
    need(spec, impl)
    # eager foreach: every grid point; fused and scripted (compiled per
    # optimizer): the pairwise cover, every value of every option and every
    # pair of values (FUNCOPT_FULL_GRID=1: every point everywhere)
    combos = list(spec.combos()) if (mode, impl) == ("eager", "foreach") else spec.pairs()
    assert combos
    for kw in combos:
        params = make_params(dtype=torch.float64)
        tparams = clone_params(params)
        fo = make(spec, params, kw, impl, mode)
        loop_flags = {k: False for k in ("foreach", "fused") if torch_accepts(spec, k)}
        to = spec.torch_cls(tparams, **kw, **loop_flags)
        for t in range(20):
            g = make_grads(params, t)
            kept = [x.clone() for x in g]
            fo.step(g)
            torch_step(to, g)
            for a, b in zip(g, kept):  # the caller's gradients are read, never written
                assert torch.equal(a, b), f"{kw}: step() modified a gradient"
        try:
            assert_params_equal(params, tparams, **PARITY_TOL)
            assert_state_equal(fo.state_dict()["state"], to.state_dict()["state"], **PARITY_TOL)
        except AssertionError as e:
            # where torch's own foreach and for-loop versions differ (ASGD in
            # float64), funcopt follows foreach: it must equal torch's foreach
            # run, and that run must differ from the for-loop like ours does
            if not torch_accepts(spec, "foreach") or _matches_torch_foreach(spec, kw, fo, params, make_params,
                                                                            make_grads, clone_params, tparams):
                raise AssertionError(f"{name} {kw}: {e}") from None


def _matches_torch_foreach(spec, kw, fo, params, make_params, make_grads, clone_params, loop_params) -> bool:
    """False when funcopt equals torch's foreach version and torch's foreach
    version itself differs from its for-loop version (a documented torch
    difference); True (the failure stands) otherwise."""
    fparams = clone_params(make_params(dtype=torch.float64))
    ref = spec.torch_cls(fparams, **kw, foreach=True)
    for t in range(20):
        torch_step(ref, make_grads(fparams, t))
    try:
        assert_params_equal(params, fparams, **PARITY_TOL)
        assert_state_equal(fo.state_dict()["state"], ref.state_dict()["state"], **PARITY_TOL)
    except AssertionError:
        return True
    return all(torch.equal(a, b) for a, b in zip(fparams, loop_params))


# ------------------------------------------------------------- step counters
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", [n for n in ALGOS if "step" in [s for s, _ in REGISTRY[n].cls.slots]
                                  # Prodigy counts in its kernel's second pass (a step may stop before it)
                                  and getattr(REGISTRY[n].cls, "core_bumps_step", True)])
def test_step_counters_of_a_full_bucket_share_one_tensor(name, impl, mode, make_params, make_grads):
    """Once every parameter of a bucket has state, its step counters are views of
    one tensor (bumped with one op); a step with a gradient missing, a load and a
    new parameter group re-home them, and the counts stay right throughout."""
    spec = REGISTRY[name]
    need(spec, impl)
    params = make_params()
    opt = make(spec, params, rich(spec), impl, mode)

    def counters():
        st = opt.state_dict()["state"]
        return [st[i]["step"] for i in sorted(st)]

    def storages():
        return {c.untyped_storage().data_ptr() for c in counters()}

    opt.step(make_grads(params, 0))
    opt.step(make_grads(params, 1))
    assert len(storages()) == 1, "the counters of one bucket do not share a tensor"
    assert [float(c) for c in counters()] == [2.0] * len(params)
    opt.step([None] + make_grads(params, 2)[1:])  # not the full bucket: one by one
    assert [float(c) for c in counters()] == [2.0] + [3.0] * (len(params) - 1)
    sd = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(sd)  # fresh tensors: re-homed at the next full step
    opt.step(make_grads(params, 3))
    assert len(storages()) == 1
    assert [float(c) for c in counters()] == [3.0] + [4.0] * (len(params) - 1)

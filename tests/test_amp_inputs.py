"""``found_inf`` / ``grad_scale`` and rejected input: validate, then mutate.

* any nonzero or NaN ``found_inf`` skips the step and leaves everything
  (parameters, state, step counters) bitwise unchanged, on every path (the
  fused kernels skip only on exactly 1.0, and the counters were corrected by
  subtracting ``found_inf``: 2.0 used to move them backwards);
* a ``found_inf`` / ``grad_scale`` of the wrong dtype, shape or device is a
  ``ValueError`` raised before anything changes;
* integer parameters, sparse gradients an algorithm refuses, Adagrad's weight
  decay with sparse gradients: torch.optim's error type, raised before any
  state is allocated or counter bumped (torch.optim itself bumps first).
"""
import copy
import inspect

import pytest
import torch

import funcopt
from _oracles import other_lr, same_value
from funcopt.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("single_thread")

ALGOS = list(REGISTRY)
IMPLS = {"auto": {}, "fused": dict(fused=True), "foreach": dict(foreach=True)}
MODES = ["eager", "scripted"]
KW = {name: spec.rich for name, spec in REGISTRY.items()}


def _impls(spec):
    """impl "auto" runs the fused kernel where torch has one on the CPU and the
    foreach path elsewhere (``Optimizer._bucket``): without a fused CPU kernel
    "auto" is the foreach path and "fused" has nothing to run, so such an
    algorithm is tested through "foreach" ("auto" where it takes no foreach=)."""
    if "cpu" in spec.fused_devices:
        return list(IMPLS)
    return ["foreach" if "foreach" in inspect.signature(spec.cls.__init__).parameters else "auto"]


CASES = [(name, impl) for name, spec in REGISTRY.items() for impl in _impls(spec)]


def _make(name, impl, mode, params, **extra):
    spec = REGISTRY[name]
    if impl == "fused" and "cpu" not in spec.fused_devices:
        pytest.skip(f"{name} has no fused CPU kernel in torch")
    opt = spec.cls(params, **dict(KW[name], **extra), **IMPLS[impl])
    return funcopt.script(opt) if mode == "scripted" else opt


def _params(name, seed=0):
    """A matrix, a vector and a scalar, each shaped as torch's class takes it
    (``spec.param_shape``: (5, 1) and (1, 1) for a matrices-only rule)."""
    g = torch.Generator().manual_seed(seed)
    spec = REGISTRY[name]
    return [torch.randn(spec.param_shape(s), generator=g).requires_grad_() for s in [(3, 4), (5,), ()]]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def snapshot(opt):
    sd = opt.state_dict()
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in e.items()}
             for i, e in sd["state"].items()}
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return params, state


def assert_unchanged(before, opt):
    params, state = snapshot(opt)
    for i, (a, b) in enumerate(zip(before[0], params)):
        assert torch.equal(a, b), f"parameter {i} changed"
    assert sorted(state) == sorted(before[1]), "state entries changed"
    for i, entry in before[1].items():
        assert sorted(entry) == sorted(state[i]), f"state[{i}] keys changed"
        for k, v in entry.items():
            assert same_value(v, state[i][k]), f"state[{i}][{k!r}] changed: {v} -> {state[i][k]}"


SKIP_VALUES = [2.0, float("nan"), 0.5, -1.0, float("inf")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,impl", CASES)
def test_any_nonzero_found_inf_skips_the_step(name, impl, mode):
    params = _params(name)
    opt = _make(name, impl, mode, params)
    for t in range(2):
        opt.step(_grads(params, t))
    before = snapshot(opt)
    for v in SKIP_VALUES:
        for shape in [(), (1,)]:
            opt.step(_grads(params, 5), found_inf=torch.full(shape, v))
            assert_unchanged(before, opt)
            opt.step(_grads(params, 5), grad_scale=torch.tensor(2.0), found_inf=torch.full(shape, v))
            assert_unchanged(before, opt)
    # and the optimizer still steps, counters from where they were
    twin_params = _params(name)
    twin = _make(name, impl, "eager", twin_params)
    for t in range(2):
        twin.step(_grads(twin_params, t))
    opt.step(_grads(params, 7), found_inf=torch.tensor(0.0))
    twin.step(_grads(twin_params, 7))
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)
    after, tw = snapshot(opt)[1], snapshot(twin)[1]
    for i, entry in tw.items():
        for k, v in entry.items():
            assert same_value(after[i][k], v), (i, k)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,impl", CASES)
def test_skipped_first_step_leaves_no_state(name, impl, mode):
    params = _params(name)
    opt = _make(name, impl, mode, params)
    before = snapshot(opt)
    for v in SKIP_VALUES:
        opt.step(_grads(params, 0), found_inf=torch.tensor(v))
        assert all(torch.equal(a, b) for a, b in zip(before[0], params))
    state = opt.state_dict()["state"]
    if REGISTRY[name].cls.split_first:
        assert state == {}, f"a skipped first {name} step left state behind"
    else:  # torch.optim allocates state on a skipped first step too: as initialised, step 0
        fresh = _make(name, impl, "eager", [p.detach().clone().requires_grad_() for p in params])
        fresh.step([torch.zeros_like(p) for p in params], found_inf=torch.tensor(1.0))
        initial = fresh.state_dict()["state"]
        assert set(state) == set(initial)
        for i, entry in state.items():
            assert set(entry) == set(initial[i])
            for k, v in entry.items():
                assert torch.equal(v, initial[i][k]), (k, v)
            if "step" in entry:
                assert float(entry["step"]) == 0.0


def _bad_amp():
    return {
        "float64": torch.tensor(1.0, dtype=torch.float64),
        "float16": torch.tensor(1.0, dtype=torch.float16),
        "int": torch.tensor(1),
        "bool": torch.tensor(True),
        "two-elements": torch.zeros(2),
        "no-elements": torch.zeros(0),
        "meta-device": torch.zeros((), device="meta"),
    }


@pytest.mark.parametrize("which", ["found_inf", "grad_scale"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,impl", CASES)
def test_bad_found_inf_or_grad_scale_is_a_clear_error(name, impl, mode, which):
    params = _params(name)
    opt = _make(name, impl, mode, params)
    opt.step(_grads(params, 0))
    before = snapshot(opt)
    for label, bad in _bad_amp().items():
        with pytest.raises(ValueError, match=which):
            opt.step(_grads(params, 1), **{which: bad})
        assert_unchanged(before, opt)
    # on a first step too: no state allocated
    fresh_params = _params(name)
    fresh = _make(name, impl, mode, fresh_params)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=which):
        fresh.step(_grads(fresh_params, 1), **{which: torch.tensor(1.0, dtype=torch.float64)})
    assert_unchanged(before, fresh)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ALGOS)
def test_integer_parameters_refused_before_any_change(name, mode):
    """torch.optim accepts integer parameters at construction and fails in the
    step (after bumping counters); we fail in the step, before any change, with
    torch's error type (RuntimeError)."""
    ok = _params(name)
    shape = REGISTRY[name].param_shape((3,))  # (3, 1) for a matrices-only rule
    ip = torch.zeros(shape, dtype=torch.long)
    opt = _make(name, "auto", mode, [{"params": ok}, {"params": [ip]}])
    opt.step(_grads(ok, 0) + [None])
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="floating point or complex"):
        opt.step(_grads(ok, 1) + [torch.ones(shape, dtype=torch.long)])
    assert_unchanged(before, opt)
    torch_opt = REGISTRY[name].torch_cls([torch.zeros(shape, dtype=torch.long)], **KW[name])
    torch_opt.param_groups[0]["params"][0].grad = torch.ones(shape, dtype=torch.long)
    with pytest.raises((RuntimeError, NotImplementedError)):  # torch's own: a kernel's dtype error
        for _ in range(2):  # (SOAP's oracle: its first step only builds the preconditioner)
            torch_opt.step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,impl", CASES)
def test_bad_input_in_a_later_bucket_changes_nothing(name, impl, mode):
    """Two groups: the bad input sits in the second; the first group's
    parameters, state and counters must not move."""
    a, b = _params(name, 0), _params(name, 1)
    opt = _make(name, impl, mode, [{"params": a}, {"params": b, "lr": other_lr(REGISTRY[name], 0.2)}])
    opt.step(_grads(a + b, 0))
    before = snapshot(opt)
    grads = _grads(a + b, 1)
    grads[-2] = torch.randn(b[-2].shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        opt.step(grads)
    assert_unchanged(before, opt)
    grads = _grads(a + b, 1)
    grads[-3] = torch.randn(b[-3].shape).to_sparse_csr()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step(grads)
    assert_unchanged(before, opt)

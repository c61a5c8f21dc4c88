"""``differentiable=True``: the step runs eagerly with grad enabled, through
torch's single-tensor formula, so autograd sees the update.  torch.optim with
``differentiable=True`` is the oracle for values and for gradients (w.r.t. the
parameters' starting values, the gradients and the state built on the way);
``torch.autograd.gradcheck`` checks our gradients numerically as torch's own
TestDifferentiableOptimizer does.  Scripted and fused refuse it clearly.
"""
import inspect
import re

import pytest
import torch
from torch.autograd import gradcheck

import funcopt
from funcopt.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("single_thread")

# every registered algorithm that torch lets differentiate: its configs with a large lr
KW = {name: [dict(kw, lr=0.5) for kw in spec.configs()] + [dict(spec.base, lr=0.5)] for name, spec in REGISTRY.items()
      if "differentiable" in inspect.signature(spec.torch_cls.__init__).parameters}
CASES = [pytest.param(n, kw, id=f"{n}-{j}") for n, kws in KW.items() for j, kw in enumerate(kws)]
STEPS = 3


def _unroll(cls, kw, p0, grads):
    """STEPS differentiable steps from ``p0`` (a non-leaf clone) with ``grads``
    (tensors requiring grad); returns the final parameter."""
    p = p0.clone()
    opt = cls([p], **kw, differentiable=True)
    for g in grads:
        p.grad = g
        opt.step()
    return p


def _outcome(cls, kw, p0, grads, w):
    try:
        p = _unroll(cls, kw, p0, grads)
        assert p.requires_grad and p.grad_fn is not None
        return p.detach(), torch.autograd.grad((p * w).sum(), [p0, *grads], allow_unused=True)
    except RuntimeError as e:  # torch's own limits (e.g. amsgrad over several steps) must be ours too
        return e, None


@pytest.mark.parametrize("name,kw", CASES)
def test_values_and_gradients_match_torch(name, kw):
    spec = REGISTRY[name]
    gen = torch.Generator().manual_seed(0)
    p0 = torch.rand(6, generator=gen, dtype=torch.float64, requires_grad=True)
    grads = [torch.rand(6, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(STEPS)]
    w = torch.rand(6, generator=gen, dtype=torch.float64)
    ours, ours_grads = _outcome(spec.cls, kw, p0, grads, w)
    want, want_grads = _outcome(spec.torch_cls, kw, p0, grads, w)
    if isinstance(want, Exception):
        # the same autograd error (version counters may differ: funcopt's state
        # allocation writes zeros in place)
        assert type(ours) is type(want), (ours, want)
        assert re.sub(r"version \d+", "", str(ours)) == re.sub(r"version \d+", "", str(want))
        return
    assert not isinstance(ours, Exception), ours
    torch.testing.assert_close(ours, want)
    for a, b in zip(ours_grads, want_grads):
        assert (a is None) == (b is None)  # e.g. SGD's first momentum buffer is a detached copy, as in torch
        if a is not None:
            torch.testing.assert_close(a, b)


# gradcheck needs every dependence to be seen by autograd: torch detaches
# SGD's first momentum buffer, and amsgrad's max cannot be differentiated over
# several steps (torch fails the same way): those are left to the test above
def _gradcheck_inputs():
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.rand(4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))


def _torch_differentiates(name, kw) -> bool:
    """Whether torch's own class passes the same gradcheck (some state cannot be
    differentiated over several steps: SGD's first momentum buffer, amsgrad's
    max, Adamax's and Rprop's in-place updates)."""
    cls = REGISTRY[name].torch_cls
    try:
        return gradcheck(lambda a, b, c: _unroll(cls, kw, a, [b, c]), _gradcheck_inputs(), raise_exception=False)
    except RuntimeError:
        return False


# those torch cannot differentiate are left to the test above
GRADCHECK = [c for c in CASES if _torch_differentiates(*c.values)]


@pytest.mark.parametrize("name,kw", GRADCHECK)
def test_gradcheck(name, kw):
    spec = REGISTRY[name]
    assert gradcheck(lambda a, b, c: _unroll(spec.cls, kw, a, [b, c]), _gradcheck_inputs())


def _diff_fn(p, grad, state, opt_class, kwargs, *ignored):
    """torch's TestDifferentiableOptimizer recipe: state put in through
    ``opt.state`` must be differentiated through too."""
    p = p.clone()
    p.grad = grad
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    opt = opt_class([p], **kwargs)
    opt.state[p].update(state)
    opt.step()
    return (p,) + tuple(v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.requires_grad)


def test_gradcheck_through_state_set_by_the_user():
    gen = torch.Generator().manual_seed(2)
    p = torch.rand(5, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.rand(5, generator=gen, dtype=torch.float64, requires_grad=True)
    state = {"momentum_buffer": torch.rand(5, generator=gen, dtype=torch.float64, requires_grad=True)}
    assert gradcheck(_diff_fn, (p, grad, state, funcopt.SGD, dict(lr=0.9, momentum=0.9, differentiable=True),
                                *state.values()))


@pytest.mark.parametrize("name", list(KW))
def test_complex_differentiable_values_match_torch(name):
    spec = REGISTRY[name]
    kw = KW[name][0]
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4, generator=gen, dtype=torch.complex128)
    grads = [torch.randn(4, generator=gen, dtype=torch.complex128) for _ in range(STEPS)]
    got = _unroll(spec.cls, kw, base.clone().requires_grad_().clone(), grads)
    want = _unroll(spec.torch_cls, kw, base.clone().requires_grad_().clone(), grads)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", list(KW))
def test_leaf_parameters_fail_like_torch_before_any_change(name):
    """torch.optim with differentiable=True fails on a leaf parameter that
    requires grad (autograd refuses the in-place update) -- after creating
    state.  Same error here, raised before anything changes."""
    spec = REGISTRY[name]
    kw = KW[name][0]
    tp = torch.rand(3, requires_grad=True)
    tref = spec.torch_cls([tp], **kw, differentiable=True)
    tp.grad = torch.rand(3)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as torch_err:
        tref.step()
    p = torch.rand(3, requires_grad=True)
    before = p.detach().clone()
    opt = spec.cls([p], **kw, differentiable=True)
    state_before = {k: v.clone() for k, v in opt.state_dict()["state"].get(0, {}).items()}
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as ours:
        opt.step([torch.rand(3)])
    assert str(ours.value) == str(torch_err.value)
    assert torch.equal(p.detach(), before)
    after = opt.state_dict()["state"].get(0, {})
    assert after.keys() == state_before.keys()
    for k, v in state_before.items():
        assert torch.equal(after[k], v), k


@pytest.mark.parametrize("name", list(KW))
def test_scripted_refuses_differentiable(name):
    """The scripted step runs without autograd: funcopt.script refuses a
    differentiable optimizer (and a scripted core refuses a differentiable
    group at step time, e.g. one switched on through param_groups), before
    any change."""
    spec = REGISTRY[name]
    p = torch.rand(3, requires_grad=True).clone()
    opt = spec.cls([p], **KW[name][0], differentiable=True)
    before = p.detach().clone()
    with pytest.raises((ValueError, RuntimeError), match="differentiable=True"):
        funcopt.script(opt)
        opt.step([torch.rand(3)])
    assert torch.equal(p.detach(), before)
    q = torch.rand(3, requires_grad=True)
    opt = funcopt.script(spec.cls([q], **KW[name][0]))
    opt.param_groups[0]["differentiable"] = True
    before = q.detach().clone()
    with pytest.raises((ValueError, RuntimeError), match="differentiable=True"):
        opt.step([torch.rand(3)])
    assert torch.equal(q.detach(), before)


@pytest.mark.parametrize("name", list(KW))
def test_fused_and_differentiable_refused_like_torch(name):
    spec = REGISTRY[name]
    if "cpu" not in spec.fused_devices:
        pytest.skip(f"{name} has no fused CPU kernel in torch")
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        spec.torch_cls([torch.rand(2, requires_grad=True)], fused=True, differentiable=True)
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        spec.cls([torch.rand(2, requires_grad=True)], fused=True, differentiable=True)

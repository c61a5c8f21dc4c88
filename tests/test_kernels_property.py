"""Property tests of the functional kernels (hypothesis).

For every registered algorithm, random parameter lists (0..4 tensors, shapes
with 0-d and empty tensors, float32/float64) and a random grid point: three
steps through the funcopt optimizer (eager or scripted; the kernel does the
work) equal ``torch.optim`` with ``fused=True`` / ``foreach=True`` bitwise.
The kernels themselves, found next to each optimizer class, are no-ops on
empty lists, eagerly and scripted.
"""
import inspect
import sys
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcopt
from _oracles import same_value
from funcopt.registry import REGISTRY
from funcopt.script import script_object

ALGOS = list(REGISTRY)
IMPLS = ["fused", "foreach"]
pytestmark = pytest.mark.usefixtures("single_thread")

SETTINGS = settings(max_examples=25, deadline=None, database=None)

shapes_st = st.lists(
    st.lists(st.integers(min_value=0, max_value=3), min_size=0, max_size=3).map(tuple),
    min_size=0,
    max_size=4,
)


def torch_accepts(spec, name):
    return name in inspect.signature(spec.torch_cls.__init__).parameters


def need(spec, impl):
    """The impl flags both classes get (``spec.torch_flags``): none where torch's
    class has a single implementation (Muon), which then runs as "foreach"."""
    if impl == "fused" and (not torch_accepts(spec, impl) or "cpu" not in spec.fused_devices):
        pytest.skip(f"{spec.name}: torch has no fused implementation on CPU")
    return spec.torch_flags({impl: True})


def kernels_of(spec):
    """Module-level functions ``f(params, grads, ...)`` defined beside the
    optimizer class or one of its funcopt bases (AdamW -> adam)."""
    found = []
    for cls in spec.cls.__mro__:
        if not (isinstance(cls, type) and issubclass(cls, funcopt.Optimizer)) or cls is funcopt.Optimizer:
            continue
        mod = sys.modules[cls.__module__]
        for f in vars(mod).values():
            if (inspect.isfunction(f) and f.__module__ == mod.__name__ and f not in found
                    and not f.__name__.startswith("_")  # the public functional kernels
                    and list(inspect.signature(f).parameters)[:2] == ["params", "grads"]):
                found.append(f)
    return found


@pytest.mark.parametrize("name", ALGOS)
def test_every_algorithm_has_a_kernel(name):
    assert kernels_of(REGISTRY[name]), f"no kernel f(params, grads, ...) found for {name}"


def _fill(hint):
    """A value of a scalar kernel argument's type (``None``: no rule for it)."""
    if hint is bool:
        return True  # every optional branch on
    if hint is float:
        return 0.1
    if hint is int:
        return 1
    if hint is torch.Tensor:  # a 0-d value (ADOPT's and AdEMAMix's group step counter)
        return torch.ones((), dtype=torch.float64)
    origin, inner = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in inner:  # Optional[X]: a value, not None
        return _fill(next(a for a in inner if a is not type(None)))
    if origin is tuple and inner and Ellipsis not in inner:
        vals = tuple(_fill(a) for a in inner)
        return None if None in vals else vals
    return None


def _empty_args(fn, fused):
    hints = typing.get_type_hints(fn)
    args = {}
    for pname, param in inspect.signature(fn).parameters.items():
        hint = hints.get(pname)
        if pname in ("grad_scale", "found_inf"):
            continue  # given separately below
        if hint == typing.List[torch.Tensor]:
            args[pname] = []
        elif pname == "fused":
            args[pname] = fused
        elif _fill(hint) is not None:
            args[pname] = _fill(hint)
        elif param.default is not inspect.Parameter.empty:
            continue
        else:  # pragma: no cover - a new kernel argument type
            raise AssertionError(f"{fn.__name__}: don't know how to fill {pname}: {hint}")
    return args


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
def test_kernel_empty_lists_are_a_no_op(name, impl, scripted):
    for fn in kernels_of(REGISTRY[name]):
        f = script_object(fn) if scripted else fn
        args = _empty_args(fn, impl == "fused")
        out = f(**args)  # None, or (a two-phase rule's first pass, Prodigy) sums of nothing: zeros
        assert out is None or all(v == 0 for v in out)
        assert all(v == [] for v in args.values() if isinstance(v, list))
        # with grad_scale / found_inf given too
        extra = {k: torch.tensor(1.0) for k in ("grad_scale", "found_inf") if k in inspect.signature(fn).parameters}
        out = f(**args, **extra)
        assert out is None or all(v == 0 for v in out)


def _run(opt_cls, params, kw, grads_per_step, is_funcopt, scripted):
    groups = [{"params": params}]
    opt = opt_cls(groups, **kw)
    if scripted:
        funcopt.script(opt)
    for grads in grads_per_step:
        if is_funcopt:
            opt.step([g.clone() for g in grads])
        else:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    return opt


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ALGOS)
@SETTINGS
@given(data=st.data())
def test_kernel_matches_torch_bitwise(name, impl, data):
    spec = REGISTRY[name]
    flags = need(spec, impl)
    # each shape as torch's class takes it (spec.param_shape: Muon matrices, Adafactor non-empty)
    shapes = [spec.param_shape(s) for s in data.draw(shapes_st, label="shapes")]
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    kw = data.draw(st.sampled_from(list(spec.combos())), label="hyper")
    scripted = data.draw(st.booleans(), label="scripted")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(3)]
    fparams = [x.clone().requires_grad_() for x in init]
    tparams = [x.clone().requires_grad_() for x in init]
    kw = dict(kw, **flags)
    fo = _run(spec.cls, fparams, kw, grads, True, scripted)
    to = _run(spec.torch_cls, tparams, kw, grads, False, False)
    for i, (a, b) in enumerate(zip(fparams, tparams)):
        assert a.shape == b.shape and torch.equal(a.detach(), b.detach()), f"param {i} ({tuple(a.shape)})"
    sf, st_ = fo.state_dict(), to.state_dict()
    assert sf["param_groups"] == st_["param_groups"]
    assert sorted(sf["state"]) == sorted(st_["state"])
    for pid, entry in st_["state"].items():
        assert list(sf["state"][pid]) == list(entry)
        for k, v in entry.items():
            mine = sf["state"][pid][k]
            # prodigyopt's int step and 0-d p0, SOAP's lists and numbers (tests/_oracles.py)
            assert same_value(mine, v), f"state[{pid}][{k!r}]"
    if not shapes:  # empty parameter list: a no-op, like torch
        assert sf["state"] == {}

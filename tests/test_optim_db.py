"""torch's own optimizer test inputs as our tests.

``torch.testing._internal.common_optimizers.optim_db`` (shipped in the wheel)
lists, per torch.optim class, the hyperparameter configurations torch tests
(``optim_inputs_func``, with the global flags foreach / fused / differentiable
added by ``_get_optim_inputs_including_global_cliquey_kwargs``) and the error
cases (``optim_error_inputs_func``).  For every funcopt algorithm: each
configuration, float32 and float64, a few steps against torch.optim with the
same configuration; each error case raises the same error type with a
message matching torch's regex (or the same warning).
"""
import re
import warnings

import pytest
import torch

from funcopt.registry import REGISTRY

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
optim_db = common_optimizers.optim_db
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum
with_global_flags = common_optimizers._get_optim_inputs_including_global_cliquey_kwargs

pytestmark = pytest.mark.usefixtures("single_thread")
STEPS = 4
SHAPES = [(3, 4), (5,), (), (2, 1, 3)]
NO_GRAD_AT_STEP_2 = 1  # the (5,) parameter skips a step (no gradient)


def _info(name):
    torch_cls = REGISTRY[name].torch_cls
    found = [i for i in optim_db if i.optim_cls is torch_cls]
    assert len(found) == 1, f"optim_db has {len(found)} entries for {torch_cls.__name__}"
    return found[0]


# algorithms whose oracle is a torch.optim class; one torch lacks (Lion) has an
# oracle written from its paper (funcopt/registry.py) and no optim_db entry
IN_DB = [name for name in REGISTRY if getattr(torch.optim, REGISTRY[name].torch_cls.__name__, None)
         is REGISTRY[name].torch_cls]


def test_every_funcopt_algorithm_is_in_optim_db():
    for name in IN_DB:
        _info(name)


def _configs():
    for name in IN_DB:
        for dtype in (torch.float32, torch.float64):
            for j, inp in enumerate(with_global_flags("cpu", dtype, _info(name))):
                yield pytest.param(name, dtype, inp.kwargs, id=f"{name}-{str(dtype)[6:]}-{j}-{inp.desc}")


def _params(spec, dtype, differentiable):
    g = torch.Generator().manual_seed(0)
    # each shape as torch's class takes it (spec.param_shape: Muon matrices only)
    ps = [torch.randn(spec.param_shape(s), generator=g, dtype=dtype) for s in SHAPES]
    # torch: differentiable=True cannot update a leaf that requires grad in place
    return [p.requires_grad_().clone() if differentiable else p.requires_grad_() for p in ps]


def _run(spec, cls, kwargs, dtype):
    params = _params(spec, dtype, kwargs.get("differentiable", False))
    opt = cls(params, **kwargs)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of a non-leaf (differentiable configs)
        for t in range(STEPS):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
                if t == 2 and i == NO_GRAD_AT_STEP_2:
                    p.grad = None  # a parameter without a gradient this step
            opt.step()
    return params, opt


@pytest.mark.parametrize("name,dtype,kwargs", list(_configs()))
def test_optim_db_inputs_match_torch(name, dtype, kwargs):
    spec = REGISTRY[name]
    fparams, fopt = _run(spec, spec.cls, kwargs, dtype)
    tparams, topt = _run(spec, spec.torch_cls, kwargs, dtype)
    for a, b in zip(fparams, tparams):
        torch.testing.assert_close(a.detach(), b.detach())
    fs, ts = fopt.state_dict(), topt.state_dict()
    assert fs["state"].keys() == ts["state"].keys()
    for i, entry in ts["state"].items():
        assert fs["state"][i].keys() == entry.keys(), i
        for k, v in entry.items():
            got = fs["state"][i][k]
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(got.detach().to(v.dtype), v.detach(), msg=lambda m: f"{i} {k}: {m}")
            else:
                assert got == v


def _error_cases():
    for name in IN_DB:
        info = _info(name)
        for dtype in (torch.float32,):
            for j, err in enumerate(info.optim_error_inputs_func(device="cpu", dtype=dtype)):
                yield pytest.param(name, err, id=f"{name}-{j}-{err.optimizer_error_input.desc}")


@pytest.mark.parametrize("name,err", list(_error_cases()))
def test_optim_db_error_inputs_match_torch(name, err):
    spec = REGISTRY[name]
    inp = err.optimizer_error_input

    def run(cls):
        if err.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            cls(inp.params, **inp.kwargs)
        else:
            cls(inp.params, **inp.kwargs).step()

    for cls in (spec.torch_cls, spec.cls):  # torch first: the case itself must hold
        if issubclass(err.error_type, Warning):
            with pytest.warns(err.error_type, match=err.error_regex):
                run(cls)
        else:
            with pytest.raises(err.error_type) as e:
                run(cls)
            assert re.search(err.error_regex, str(e.value)), f"{cls.__module__}: {e.value!r}"

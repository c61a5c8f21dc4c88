"""torch's optimizer surface as frameworks call it, and torch.distributed.checkpoint in
one process.  Needs no framework.

* ``step(closure=fn)`` and ``step(fn)`` return the closure's loss and step as
  torch.optim's ``step(closure)`` does (the closure runs with grad enabled, also under
  ``torch.no_grad()``), while funcopt's own arguments keep working: a positional list
  of gradients, ``grads=``, ``grad_scale=``, ``found_inf=``;
* the distributed optimizers take what torch's take (``ZeroRedundancyOptimizer.step(closure,
  **kwargs)``, ``DistributedOptimizer.step(context_id)``); ZeRO's closure runs are in
  ``tests/distributed/test_fsdp2_dcp.py``;
* ``get_state_dict`` / ``get_optimizer_state_dict`` / ``set_state_dict`` and
  ``dcp.save`` / ``dcp.load``: the run resumed from the checkpoint equals the
  uninterrupted one exactly, and the state equals torch.optim's.

Every registry algorithm (rich configuration), eager and scripted, against the
torch.optim class of the same name (``foreach=True``: the op order funcopt follows).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

from _common import algorithm_cases, assert_close, assert_equal, assert_trained, make_optimizer, snapshot, tiny_model
from _common import tiny_data
from _oracles import oracle_form
from funcopt.registry import REGISTRY

CASES = algorithm_cases()
STEPS, SAVE = 4, 2


def _closure(model, opt, step):
    x, y = tiny_data().tensors
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[8 * step:8 * step + 8]), y[8 * step:8 * step + 8])
        loss.backward()
        return loss
    return closure, calls


def _run_closure(name, flavour, how):
    model = tiny_model()
    opt = make_optimizer(name, flavour, model.parameters())
    losses = []
    # torch.optim's step enables grad for the closure, and so does funcopt's; an oracle
    # outside torch may not (prodigyopt calls it as it finds it): it runs as its docs show
    outside = flavour == "torch" and REGISTRY[name].oracle_package is not None
    for step in range(STEPS):
        closure, calls = _closure(model, opt, step)
        with contextlib.nullcontext() if outside else torch.no_grad():
            loss = opt.step(closure=closure) if how == "keyword" else opt.step(closure)
        assert calls == [True], f"closure called {len(calls)} times, grad enabled: {calls}"
        losses.append(loss.detach())
    return snapshot(model.parameters()), losses


@pytest.mark.parametrize("how", ["keyword", "position"])
@pytest.mark.parametrize("name,flavour", CASES)
def test_step_closure_matches_torch_optim(name, flavour, how):
    want, want_losses = _run_closure(name, "torch", how)
    got, losses = _run_closure(name, flavour, how)
    assert_trained(snapshot(tiny_model().parameters()), want, f"{name} torch.optim")
    assert_close(got, want, f"{name} {flavour} step({how} closure) vs torch.optim", algo=name)
    assert_close(losses, want_losses, f"{name} {flavour}: losses returned by step", algo=name)


@pytest.mark.parametrize("name,flavour", CASES)
def test_funcopt_step_arguments_still_work(name, flavour):
    """A gradient list by position, ``grads=``, and ``grad_scale=`` / ``found_inf=`` as
    keywords give the same step as ``p.grad`` (found_inf=1 skips it)."""
    def run(call):
        model = tiny_model()
        opt = make_optimizer(name, flavour, model.parameters())
        params = [p for g in opt.param_groups for p in g["params"]]
        for step in range(STEPS):
            closure, _ = _closure(model, opt, step)
            closure()
            call(opt, [p.grad.clone() for p in params])
        return snapshot(model.parameters())

    want = run(lambda opt, g: opt.step())
    assert_equal(run(lambda opt, g: opt.step(g)), want, f"{name} {flavour} step(grads)")
    assert_equal(run(lambda opt, g: opt.step(grads=g)), want, f"{name} {flavour} step(grads=)")
    assert_equal(run(lambda opt, g: opt.step(grads=[x * 4 for x in g], grad_scale=torch.tensor(4.0),
                                             found_inf=torch.tensor(0.0))), want, f"{name} {flavour} grad_scale=")
    assert_equal(run(lambda opt, g: opt.step(grads=g, found_inf=torch.tensor(1.0))),
                 snapshot(tiny_model().parameters()), f"{name} {flavour} found_inf=1")


def test_distributed_step_signatures_are_torchs():
    from torch.distributed.optim import DistributedOptimizer as TorchRPC
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from funcopt.distributed.rpc import DistributedOptimizer
    from funcopt.distributed.zero import ZeroRedundancyOptimizer

    assert list(inspect.signature(DistributedOptimizer.step).parameters) == \
        list(inspect.signature(TorchRPC.step).parameters) == ["self", "context_id"]
    zero = inspect.signature(ZeroRedundancyOptimizer.step).parameters
    torch_zero = inspect.signature(TorchZero.step).parameters
    assert list(zero)[:2] == list(torch_zero)[:2] == ["self", "closure"]
    assert zero["closure"].default is None and zero["closure"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in zero.values())


def _train(model, opt, steps):
    x, y = tiny_data().tensors
    for step in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[8 * step:8 * step + 8]), y[8 * step:8 * step + 8]).backward()
        opt.step()


@pytest.mark.parametrize("name,flavour", CASES)
def test_dcp_state_dict_save_load_resumes_exactly(name, flavour, tmp_path):
    """One process: get_state_dict + dcp.save after SAVE steps; a fresh model and optimizer
    get_state_dict + dcp.load + set_state_dict and continue: equal to the uninterrupted run;
    get_optimizer_state_dict equals torch.optim's."""
    model = tiny_model()
    opt = make_optimizer(name, flavour, model.parameters())
    _train(model, opt, range(SAVE))
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "no process group, saving in one process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    _train(model, opt, range(SAVE, STEPS))

    model2 = tiny_model()
    opt2 = make_optimizer(name, flavour, model2.parameters())
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _train(model2, opt2, range(SAVE, STEPS))
    assert_equal(snapshot(model2.parameters()), snapshot(model.parameters()), f"{name} {flavour}: resumed vs straight")

    oracle = tiny_model()
    topt = make_optimizer(name, "torch", oracle.parameters())
    _train(oracle, topt, range(STEPS))
    assert_close(snapshot(model.parameters()), snapshot(oracle.parameters()), f"{name} {flavour} vs torch.optim",
                 algo=name)
    got, want = get_optimizer_state_dict(model, opt), get_optimizer_state_dict(oracle, topt)
    assert sorted(got["state"]) == sorted(want["state"])
    for fqn, entry in want["state"].items():
        assert sorted(got["state"][fqn]) == sorted(entry), f"{name}: state[{fqn}] keys"
        mine, theirs = [], []
        for k, v in got["state"][fqn].items():
            pairs = (list(zip(v, entry[k])) if isinstance(v, (list, tuple)) else [(v, entry[k])])
            if isinstance(v, (list, tuple)):  # SOAP's GG / Q: a matrix per dimension
                assert len(v) == len(entry[k]), f"{name}: state[{fqn}][{k}] length"
            for a, b in pairs:  # an oracle's own forms: prodigyopt's int step (tests/_oracles.py)
                a, b = oracle_form(torch.as_tensor(a), b)
                mine.append(a)
                theirs.append(torch.as_tensor(b))
        assert_close(mine, theirs, f"{name} {flavour} state[{fqn}]", algo=name)

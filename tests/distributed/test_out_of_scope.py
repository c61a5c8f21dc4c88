"""torch.optim.LBFGS and torch.optim.SparseAdam are refused, never run per shard.

Every entry point that maps an optimizer (class or instance) to a funcopt rule
-- ``ZeroRedundancyOptimizer`` (ZeRO-1/2), the ZeRO-3 roots' sharded
checkpoints (``save_sharded``/``load_sharded(optimizer=...)``), the RPC
``DistributedOptimizer``, ``funcopt.script``, ``funcopt.step_in_backward`` and
``funcopt.registry.get`` -- raises one ``TypeError`` that names the entry
point, says why funcopt has no such rule and lists what is supported; it does
so at construction, before any collective or RPC (every collective and RPC
call is made to fail loudly while the refusal runs, so a refusal that talked
to another rank first would fail differently) and before anything changes.
A user's own per-parameter ``torch.optim`` subclass still runs eagerly.

In-process, W=1: a gloo group of one rank and one TensorPipe RPC worker.
"""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
from torch import nn

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

import torch.distributed.rpc as rpc  # noqa: E402

import funcopt  # noqa: E402
from funcopt import registry  # noqa: E402
from funcopt.distributed import DistributedOptimizer, ZeroRedundancyOptimizer  # noqa: E402
from funcopt.distributed.zero.root3 import Zero3Sequential  # noqa: E402
from funcopt.distributed.zero.stage3 import Zero3Layer  # noqa: E402

from _dist_harness import UserRMSprop  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class MyLBFGS(torch.optim.LBFGS):
    """A user's subclass of an out-of-scope class: refused like its base."""


# (class, the torch.optim class it is) for every refusal
CLASSES = [(torch.optim.LBFGS, "LBFGS"), (torch.optim.SparseAdam, "SparseAdam"), (MyLBFGS, "LBFGS")]
IDS = ["LBFGS", "SparseAdam", "subclass-of-LBFGS"]

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter_tensor", "barrier", "monitored_barrier",
               "send_object_list", "recv_object_list", "scatter_object_list", "gather_object")


def _assert_refusal(err: pytest.ExceptionInfo, where: str, base: str) -> None:
    msg = str(err.value)
    assert msg.startswith(f"{where}: funcopt has no "), msg
    assert base in msg and registry._OUT_OF_SCOPE[base] in msg, msg  # why
    assert "supported: " + ", ".join(registry.REGISTRY) in msg, msg  # what instead


def _params() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()]


def _forbid_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.distributed collective raises from now on (``monkeypatch.undo()`` lifts it)."""

    def forbidden(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"collective {name} issued")
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbidden(name))


@pytest.fixture
def no_collectives(monkeypatch):
    _forbid_collectives(monkeypatch)
    return monkeypatch


# ------------------------------------------------------------------ ZeRO-1/2
def test_the_collective_guard_is_effective(gloo_world_of_one, no_collectives):
    # a supported class does talk to the group at construction: the guard sees it
    with pytest.raises(AssertionError, match="collective .* issued"):
        ZeroRedundancyOptimizer(_params(), torch.optim.Adam, lr=0.1)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("cls,base", CLASSES, ids=IDS)
def test_zero_refuses_at_construction(gloo_world_of_one, no_collectives, cls, base, stage):
    params = _params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError) as err:
        ZeroRedundancyOptimizer(params, cls, zero_stage=stage, lr=0.1)
    _assert_refusal(err, "ZeroRedundancyOptimizer", base)
    assert "any other torch.optim.Optimizer subclass whose update is per parameter" in str(err.value)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    # nothing was left behind: the same parameters and group still build and step a ZeRO optimizer
    no_collectives.undo()
    opt = ZeroRedundancyOptimizer(params, torch.optim.SGD, zero_stage=stage, lr=0.1)
    sum(p.sum() for p in params).backward()
    opt.step()
    assert all(torch.equal(p.detach(), b - 0.1) for p, b in zip(params, before))


def test_zero_still_runs_a_users_per_parameter_subclass_eagerly(gloo_world_of_one):
    params, ref_params = _params(), _params()
    opt = ZeroRedundancyOptimizer(params, UserRMSprop, lr=0.01, momentum=0.5)
    assert opt.spec is None and opt.partition == "greedy"  # not mapped to a funcopt rule
    ref = torch.optim.RMSprop(ref_params, lr=0.01, momentum=0.5)
    for k in range(3):
        for ps, o in ((params, opt), (ref_params, ref)):
            o.zero_grad()
            sum(((k + 1) * p.square()).sum() for p in ps).backward()
            o.step()
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    assert not torch.equal(params[0], _params()[0])


# ------------------------------------------------------------------ ZeRO-3
def _zero3_model() -> Zero3Sequential:
    torch.manual_seed(0)
    return Zero3Sequential([Zero3Layer(nn.Linear(3, 4)), Zero3Layer(nn.Linear(4, 2))])


def test_zero3_collective_guard_is_effective(gloo_world_of_one, monkeypatch, tmp_path):
    model = _zero3_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _forbid_collectives(monkeypatch)
    with pytest.raises(AssertionError, match="collective .* issued"):
        model.save_sharded(str(tmp_path / "ckpt"), optimizer=opt)


@pytest.mark.parametrize("method", ["save_sharded", "load_sharded"])
@pytest.mark.parametrize("cls,base", CLASSES, ids=IDS)
def test_zero3_checkpoint_refuses_the_optimizer(gloo_world_of_one, monkeypatch, tmp_path, cls, base, method):
    model = _zero3_model()  # (building the layers is collective)
    opt = cls(model.parameters(), lr=0.1)
    _forbid_collectives(monkeypatch)
    before = [p.detach().clone() for p in model.parameters()]
    path = tmp_path / "ckpt"
    with pytest.raises(TypeError) as err:
        getattr(model, method)(str(path), optimizer=opt)
    _assert_refusal(err, "save_sharded/load_sharded(optimizer=...)", base)
    assert not path.exists()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ------------------------------------------------------------------ RPC
def test_rpc_refuses_before_any_rpc(rpc_world_of_one, monkeypatch):
    rrefs = [rpc.RRef(p) for p in _params()]

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("RPC issued")

    for name in ("rpc_async", "rpc_sync", "remote"):
        monkeypatch.setattr(rpc, name, forbidden)
    for (cls, base), label in zip(CLASSES + [("LBFGS", "LBFGS")], IDS + ["name"]):
        with pytest.raises(TypeError) as err:
            DistributedOptimizer(cls, rrefs, lr=0.1)
        _assert_refusal(err, "DistributedOptimizer", base)
    monkeypatch.undo()
    # the guard is effective: a supported class does call the owners
    monkeypatch.setattr(rpc, "rpc_async", forbidden)
    with pytest.raises(AssertionError, match="RPC issued"):
        DistributedOptimizer(torch.optim.Adam, rrefs, lr=0.1)


# --------------------------------------------- funcopt.script, step_in_backward, registry.get
@pytest.mark.parametrize("cls,base", CLASSES, ids=IDS)
def test_script_and_step_in_backward_refuse_instances_and_classes(cls, base):
    params = _params()
    opt = cls(params, lr=0.1)
    state = opt.state_dict()
    for obj in (opt, cls):
        with pytest.raises(TypeError) as err:
            funcopt.script(obj)
        _assert_refusal(err, "funcopt.script", base)
    with pytest.raises(TypeError) as err:
        funcopt.step_in_backward(opt)
    _assert_refusal(err, "funcopt.step_in_backward", base)
    assert opt.state_dict() == state and not opt._optimizer_step_pre_hooks
    for obj in (cls, opt):
        with pytest.raises(TypeError) as err:
            registry.get(obj)
        _assert_refusal(err, "funcopt.registry.get", base)


def test_registry_get_still_maps_supported_and_unknown_names():
    assert registry.get(torch.optim.Adam) is registry.REGISTRY["Adam"]
    assert registry.out_of_scope(UserRMSprop) is None and registry.out_of_scope(torch.optim.RMSprop) is None
    with pytest.raises(KeyError, match="no funcopt algorithm"):
        registry.get(UserRMSprop)
    with pytest.raises(TypeError, match="expects a funcopt optimizer"):
        funcopt.script(torch.optim.RMSprop(_params()))

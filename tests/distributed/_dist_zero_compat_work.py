"""What the ranks of tests/distributed/test_zero_compat.py run, and the single-process oracles.

Drop-in behaviours of ZeroRedundancyOptimizer beyond the training matrix of
test_zero.py: ZeRO-2 with ``torch.amp.GradScaler`` (oracle: DDP + torch.optim
+ GradScaler in the same ranks), hyperparameters that differ between ranks,
strided parameters (channels_last, transposed, a slice of a larger tensor,
0-d, ~1M elements), optimizer classes funcopt has no algorithm for (run
eagerly, as torch does), ``Join`` with uneven inputs.  Every rank computes
the full-batch gradient, so the oracle of the non-AMP cases is plain
single-process torch.optim (:func:`reference`, run in the parent).
"""
from __future__ import annotations

import copy
import gc
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

from funcopt.distributed import DistributedError, ZeroRedundancyOptimizer

from _dist_harness import Net, UserRMSprop, batch, local_slice, run_cases, snapshot

STEPS = 5


# ------------------------------------------------------------ strided model
class StridedNet(nn.Module):
    """Parameters of every layout: a channels_last conv weight (4-D), a transposed 2-D
    parameter, a slice of a larger tensor (shares its storage), a 0-d parameter, a
    contiguous bias; ``big`` adds a ~1M-element channels_last parameter."""

    def __init__(self, big: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.base = torch.randn(6, 10)  # not a parameter: the slice's storage
        self.sl = nn.Parameter(self.base[:, 2:7])
        self.tr = nn.Parameter(torch.randn(5, 4).t())
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.huge = nn.Parameter(torch.randn(256, 64, 8, 8).to(memory_format=torch.channels_last) * 0.01) \
            if big else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).mean(dim=(2, 3))  # (B, 4)
        h = torch.tanh(h @ self.tr) @ self.sl.t()  # (B, 6)
        out = h * self.scale
        if self.huge is not None:
            out = out + (self.huge.square().mean() * x.mean())
        return out


def strided_batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 3, 6, 6, generator=g), torch.randn(8, 6, generator=g)


def layouts(model: nn.Module) -> List[tuple]:
    return [(tuple(p.stride()), p.is_contiguous(), p.is_contiguous(memory_format=torch.channels_last)
             if p.dim() == 4 else None) for p in model.parameters()]


STRIDED = [
    dict(name="strided-adam-flat", algo="Adam", hyper=dict(lr=0.05, weight_decay=0.1), partition="flat",
         view=False, stage=1),
    dict(name="strided-sgd-greedy", algo="SGD", hyper=dict(lr=0.1, momentum=0.9), partition="greedy",
         view=False, stage=1),
    dict(name="strided-adamw-flat-view", algo="AdamW", hyper=dict(lr=0.05), partition="flat", view=True, stage=1),
    dict(name="strided-adagrad-greedy-view", algo="Adagrad", hyper=dict(lr=0.1), partition="greedy", view=True,
         stage=1),
    dict(name="strided-adam-z2", algo="Adam", hyper=dict(lr=0.05), partition="flat", view=False, stage=2),
    dict(name="strided-rmsprop-eager", algo="UserRMSprop", hyper=dict(lr=0.01, momentum=0.5), partition=None,
         view=False, stage=1),
    dict(name="strided-big-sgd-flat", algo="SGD", hyper=dict(lr=0.1), partition="flat", view=False, stage=1,
         big=True),
]


def _torch_cls(algo: str) -> type:
    return UserRMSprop if algo == "UserRMSprop" else getattr(torch.optim, algo)


def train_strided(case: Dict[str, Any], model: StridedNet, opt: Any) -> Dict[str, Any]:
    ptrs = [p.data_ptr() for p in model.parameters()]
    for s in range(STEPS):
        x, y = strided_batch(s)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out = dict(params=[p.detach().clone() for p in model.parameters()], layouts=layouts(model),
               slice_shares=model.sl.data_ptr() == model.base[:, 2:].data_ptr(),
               ptrs_kept=[a == p.data_ptr() for a, p in zip(ptrs, model.parameters())])
    return out


def reference_strided(case: Dict[str, Any]) -> Dict[str, Any]:
    model = StridedNet(case.get("big", False))
    opt = _torch_cls(case["algo"])(model.parameters(), **case["hyper"])
    return train_strided(case, model, opt)


def run_strided(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    model = StridedNet(case.get("big", False))
    before = layouts(model)
    kw = dict(parameters_as_bucket_view=case["view"], zero_stage=case["stage"])
    if case["partition"] is not None:
        kw["partition"] = case["partition"]
    opt = ZeroRedundancyOptimizer(model.parameters(), _torch_cls(case["algo"]), **kw, **case["hyper"])
    out = train_strided(case, model, opt)
    out["layouts_before"] = before
    return out


# ------------------------------------------------------------------- AMP
AMP = [
    dict(name="amp-z2-adam-flat", algo="Adam", hyper=dict(lr=0.01), partition="flat", stage=2, view=False),
    dict(name="amp-z2-sgd-greedy-view", algo="SGD", hyper=dict(lr=0.05, momentum=0.9), partition="greedy",
         stage=2, view=True),
    dict(name="amp-z1-adamw", algo="AdamW", hyper=dict(lr=0.01), partition="flat", stage=1, view=False),
]
AMP_STEPS, INF_STEP, INF_RANK = 6, 2, 0


def _amp_train(case: Dict[str, Any], rank: int, world: int, zero: bool) -> Dict[str, Any]:
    """Scaled losses, one step (INF_STEP) whose gradient of ``l3.bias`` is inf on rank INF_RANK
    only (in the flat partition that element belongs to another rank)."""
    model = Net()
    net = DDP(model) if (not zero or case["stage"] == 1) else model
    cls = _torch_cls(case["algo"])
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), cls, partition=case["partition"], zero_stage=case["stage"],
                                      parameters_as_bucket_view=case["view"], **case["hyper"])
    else:
        opt = cls(model.parameters(), **case["hyper"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    params, scales, skipped = [], [], []
    for s in range(AMP_STEPS):
        x, y = batch(s, model)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), y)
        if s == INF_STEP and rank == INF_RANK:
            loss = loss + float("inf") * model.l3.bias.sum()
        before = snapshot(model.parameters())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        after = snapshot(model.parameters())
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, after)))
        params.append(after)
        scales.append(scaler.get_scale())
    if zero:
        opt.consolidate_state_dict(0)
        sd = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    else:
        sd = copy.deepcopy(opt.state_dict())
    return dict(params=params, scales=scales, skipped=skipped, sd=sd)


def run_amp(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    return dict(zero=_amp_train(case, rank, world, zero=True), ddp=_amp_train(case, rank, world, zero=False))


# --------------------------------------------------- hyperparameter checks
def _catch(fn: Callable[[], Any]) -> Dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        return dict(error=None, type=None, seconds=time.monotonic() - t0)
    except Exception as e:  # the test asserts which type
        return dict(error=str(e), type=type(e).__name__, seconds=time.monotonic() - t0)


def run_hyper(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Ranks constructing with different hyperparameters: DistributedError on every rank, naming the key."""
    model = Net()
    ps = list(model.parameters())
    out: Dict[str, Any] = {}
    out["lr"] = _catch(lambda: ZeroRedundancyOptimizer(ps, torch.optim.Adam, lr=0.01 * (1 + rank)))
    out["betas"] = _catch(lambda: ZeroRedundancyOptimizer(
        ps, torch.optim.Adam, lr=0.01, betas=(0.9, 0.999 if rank == 0 else 0.99)))
    groups = [dict(params=ps[:2]), dict(params=ps[2:], weight_decay=0.1 if rank == world - 1 else 0.0)]
    out["group-weight_decay"] = _catch(lambda: ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1))
    out["eager-momentum"] = _catch(lambda: ZeroRedundancyOptimizer(
        ps, UserRMSprop, lr=0.01, momentum=0.1 * rank))
    # the same values given differently (key order, list vs tuple) are the same
    kw = dict(lr=0.01, betas=(0.9, 0.99)) if rank == 0 else dict(betas=[0.9, 0.99], lr=0.01)
    out["same-values"] = _catch(lambda: ZeroRedundancyOptimizer(ps, torch.optim.Adam, **kw))
    opt = ZeroRedundancyOptimizer(ps[:4], torch.optim.Adam, lr=0.01)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = snapshot(ps)
    out["add-group-lr"] = _catch(lambda: opt.add_param_group(dict(params=ps[4:], lr=0.1 if rank == 0 else 0.2)))
    out["groups-after"] = len(opt.param_groups)
    out["add-group-ok"] = _catch(lambda: opt.add_param_group(dict(params=ps[4:], lr=0.1)))
    opt.step()
    out["params-changed"] = not all(torch.equal(a, b) for a, b in zip(before, snapshot(ps)))
    # sparse parameters: refused on every rank
    out["sparse"] = _catch(lambda: ZeroRedundancyOptimizer([torch.sparse_coo_tensor(size=(2, 3))],
                                                           torch.optim.SGD, lr=0.1))
    return out


# ------------------------------------------------------------- eager class
class SGDWithKwarg(torch.optim.SGD):
    """A custom torch.optim class (funcopt has no algorithm for it): step takes a kwarg."""

    def step(self, closure: Any = None, seen: Any = None) -> Any:  # type: ignore[override]
        if seen is not None:
            seen.append(len(self.param_groups[0]["params"]))
        return super().step(closure)


EAGER = [
    dict(name="eager-rmsprop", cls="UserRMSprop", hyper=dict(lr=0.01, momentum=0.9, centered=True), stage=1),
    dict(name="eager-custom-sgd", cls="SGDWithKwarg", hyper=dict(lr=0.05, momentum=0.9), stage=1),
    dict(name="eager-rmsprop-z2", cls="UserRMSprop", hyper=dict(lr=0.01), stage=2),
]


def eager_cls(case: Dict[str, Any]) -> type:
    return SGDWithKwarg if case["cls"] == "SGDWithKwarg" else _torch_cls(case["cls"])


def train_eager(model: Net, opt: Any, steps: range, kwargs: Dict[str, Any]) -> None:
    for s in steps:
        x, y = batch(s, model)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step(**kwargs)


def reference_eager(case: Dict[str, Any]) -> Dict[str, Any]:
    model = Net()
    opt = eager_cls(case)(model.parameters(), **case["hyper"])
    train_eager(model, opt, range(STEPS), {})
    out = dict(p5=snapshot(model.parameters()), sd5=copy.deepcopy(opt.state_dict()))
    train_eager(model, opt, range(STEPS, STEPS + 2), {})
    out["p7"] = snapshot(model.parameters())
    return out


def run_eager(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    model = Net()
    cls = eager_cls(case)
    opt = ZeroRedundancyOptimizer(model.parameters(), cls, zero_stage=case["stage"], **case["hyper"])
    seen: List[int] = []
    kwargs = dict(seen=seen) if case["cls"] == "SGDWithKwarg" else {}
    train_eager(model, opt, range(STEPS), kwargs)
    out: Dict[str, Any] = dict(p5=snapshot(model.parameters()), seen=seen)
    mine = [p for g in opt.optim.param_groups for p in g["params"]]
    all_params = list(model.parameters())
    out["local_is_params"] = all(any(q is p for p in all_params) for q in mine)
    out["local_numel"] = sum(p.numel() for p in mine)
    out["state_keyed_by_param"] = all(p in opt.optim.state for p in mine)
    opt.consolidate_state_dict(0)
    sd = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    out["sd5"] = sd
    # reload the consolidated state into a fresh ZeRO over the same parameters, continue
    box = [sd]
    dist.broadcast_object_list(box, src=0)
    del opt  # a new optimizer over the same parameters (ZeRO-2: the old one's hooks go quiet)
    gc.collect()
    opt2 = ZeroRedundancyOptimizer(model.parameters(), cls, zero_stage=case["stage"], **case["hyper"])
    opt2.load_state_dict(box[0])
    train_eager(model, opt2, range(STEPS, STEPS + 2), kwargs)
    out["p7"] = snapshot(model.parameters())
    out["flat-refused"] = _catch(lambda: ZeroRedundancyOptimizer(model.parameters(), cls, partition="flat",
                                                                 **case["hyper"]))
    return out


# -------------------------------------------------------------------- join
JOIN_ITERS = {0: 2, 1: 4}  # rank -> iterations: rank 0 joins early


def join_grads(it: int, model: Net) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + it)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def reference_join() -> List[torch.Tensor]:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for it in range(max(JOIN_ITERS.values())):
        for p, g in zip(model.parameters(), join_grads(it, model)):
            p.grad = g
        opt.step()
    return snapshot(model.parameters())


class _SetGrads(JoinHook):
    def __init__(self, setter: "_GradSetter"):
        self.setter = setter

    def main_hook(self) -> None:
        self.setter.set_next()


class _GradSetter(Joinable):
    """Sets every iteration's gradients, also on a rank that has joined (runs before ZeRO's hook)."""

    def __init__(self, model: Net):
        super().__init__()
        self.model, self.it = model, 0

    def set_next(self) -> None:
        for p, g in zip(self.model.parameters(), join_grads(self.it, self.model)):
            p.grad = g
        self.it += 1

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _SetGrads(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def run_join(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    model = Net()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    setter = _GradSetter(model)
    with Join([setter, opt]):
        for _ in range(JOIN_ITERS[rank]):
            Join.notify_join_context(setter)
            setter.set_next()
            opt.step()
    z2 = ZeroRedundancyOptimizer(Net().parameters(), torch.optim.Adam, zero_stage=2, lr=0.01)
    return dict(params=snapshot(model.parameters()), z2_join=_catch(lambda: z2.join_hook()))


CASES = ([dict(kind="amp", **c) for c in AMP] + [dict(kind="strided", **c) for c in STRIDED]
         + [dict(kind="eager", **c) for c in EAGER]
         + [dict(kind="hyper", name="hyper"), dict(kind="join", name="join")])


def worker(rank: int, world: int, out_dir: str, cases: List[Dict[str, Any]]) -> None:
    runners = dict(amp=run_amp, strided=run_strided, eager=run_eager, hyper=run_hyper, join=run_join)
    run_cases(rank, out_dir, cases, lambda c: runners[c["kind"]](c, rank, world))

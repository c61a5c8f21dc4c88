"""What the processes of tests/distributed/test_rpc_whole.py run (trainer + one
parameter server), and the single-process oracle.

For every registry algorithm that needs whole parameters (``spec.whole_params``:
Adafactor, Muon), as the torch.optim class and as the funcopt class: a
two-layer model whose tensors live on ``ps``, the optimizer over the tensors
the class accepts (Muon: the matrices), trained from the trainer through
dist_autograd; the oracle is torch.optim on the same tensors in one process.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from funcopt.distributed import DistributedOptimizer
from funcopt.registry import REGISTRY

from _dist_whole_work import accepted

IN, HID, OUT, BATCH, STEPS = 6, 8, 3, 16, 5
NAMES = ("trainer", "ps")


def name_of(rank: int) -> str:
    return NAMES[rank]


def init_params() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(HID, IN, generator=g) * 0.5, torch.randn(HID, generator=g) * 0.1,
            torch.randn(OUT, HID, generator=g) * 0.5, torch.randn(OUT, generator=g) * 0.1]


def batch(k: int):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def forward(ps: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ ps[0].t() + ps[1]) @ ps[2].t() + ps[3]


def cases() -> List[Dict[str, Any]]:
    return [dict(name=f"{n}:{kind}", algo=n, kind=kind)
            for n, spec in REGISTRY.items() if spec.whole_params for kind in ("torch", "funcopt")]


# ------------------------------------------------------------- on the ps
def _new_param(value: torch.Tensor) -> torch.Tensor:
    return value.detach().clone().requires_grad_()


def _remote_forward(rrefs: List[rpc.RRef], x: torch.Tensor) -> torch.Tensor:
    return forward([r.local_value() for r in rrefs], x)


def _fetch(rrefs: List[rpc.RRef]) -> List[torch.Tensor]:
    return [r.local_value().detach().clone() for r in rrefs]


# ------------------------------------------------------------ the trainer
def _run(case: Dict[str, Any]) -> Dict[str, Any]:
    spec = REGISTRY[case["algo"]]
    init = init_params()
    rrefs = [rpc.remote("ps", _new_param, args=(t,)) for t in init]
    keep = {id(t) for t in accepted(case["algo"], init)}
    mine = [r for r, t in zip(rrefs, init) if id(t) in keep]
    cls = spec.torch_cls if case["kind"] == "torch" else spec.cls
    opt = DistributedOptimizer(cls, mine, **spec.rich)
    losses = []
    for k in range(STEPS):
        x, y = batch(k)
        with dist_autograd.context() as ctx:
            loss = F.mse_loss(rpc.rpc_sync("ps", _remote_forward, args=(rrefs, x)), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
    return dict(params=rpc.rpc_sync("ps", _fetch, args=(rrefs,)), losses=losses)


def role(rank: int, world: int) -> Dict[str, Any]:
    if name_of(rank) != "trainer":
        return {}
    out: Dict[str, Any] = {}
    for case in cases():
        try:
            out[case["name"]] = _run(case)
        except Exception as e:  # recorded; the next case runs
            out[case["name"]] = {"__error__": f"{type(e).__name__}: {e}"}
    return out


def reference(case: Dict[str, Any]) -> Dict[str, Any]:
    spec = REGISTRY[case["algo"]]
    params = [t.clone().requires_grad_() for t in init_params()]
    opt = spec.torch_cls(accepted(case["algo"], params), **spec.rich)
    losses = []
    for k in range(STEPS):
        x, y = batch(k)
        opt.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        loss = F.mse_loss(forward(params, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(params=[p.detach() for p in params], losses=losses)

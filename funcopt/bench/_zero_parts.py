"""Model, peers and measurements of ``funcopt bench zero`` (see :mod:`funcopt.bench.zero`)."""
from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._report import quiet_profiler

PEERS = {
    "ddp_adam": "DDP + Adam(fused)",
    "torch_zero": "DDP + torch ZeRO",
    "torch_zero_bv": "DDP + torch ZeRO (bucket view)",
    "f_flat": "DDP + funcopt ZeRO-1 flat",
    "f_greedy": "DDP + funcopt ZeRO-1 greedy",
    "f_flat_bv": "DDP + funcopt ZeRO-1 flat (bucket view)",
    "f_z2": "funcopt ZeRO-2 (no DDP)",
    "f_z2_bv": "funcopt ZeRO-2 (no DDP, bucket view)",
}
MiB = 1024 * 1024


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1000, "M": 1000_000, "G": 1000_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


# ------------------------------------------------------------------ model / data
def build_model(n_params: int, width: int, seed: int) -> torch.nn.Module:
    layers = max(1, round(n_params / (width * width + width)))
    torch.manual_seed(seed)
    mods: List[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def make_batches(n: int, world: int, rank: int, batch: int, width: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        x = torch.randn(world * batch, width, generator=g)
        y = torch.randn(world * batch, width, generator=g)
        out.append((x[rank * batch:(rank + 1) * batch].contiguous(), y[rank * batch:(rank + 1) * batch].contiguous()))
    return out


# ------------------------------------------------------------------------ peers
class Peer:
    def __init__(self, key: str, model: torch.nn.Module, net: torch.nn.Module, opt: Any):
        self.key, self.name = key, PEERS[key]
        self.model, self.net, self.opt = model, net, opt
        self.params = list(model.parameters())
        self.fb: List[float] = []
        self.st: List[float] = []
        self.grad_bytes = 0
        self.grad_pending = 0
        self.grad_peak = 0

    def is_funcopt(self) -> bool:
        return self.key.startswith(("f_", "p_"))

    def state_bytes(self) -> int:
        if self.is_funcopt():
            return int(self.opt.state_bytes())
        optim = self.opt.optim if hasattr(self.opt, "optim") else self.opt  # torch ZeRO: its local optimizer
        return sum(t.numel() * t.element_size() for st in optim.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))

    def held_grad_bytes(self) -> int:
        if self.key.startswith("f_z2"):
            return int(self.opt.grad_shard_bytes())
        return sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)

    def bucket_bytes(self) -> int:
        """ZeRO-2: the reduce-scatter bucket still waiting for its flush (not in grad_shard_bytes())."""
        bucketer = getattr(self.opt, "_bucketer", None)
        if bucketer is None:
            return 0
        # the part holding data (world rows x offset); the buffer itself is allocated at full
        # capacity (world x bucket_size_mb / world), untouched pages beyond the offset aside
        return sum(b.data.size(0) * b.offset * b.data.element_size() for b in bucketer.buckets.values())


def make_peer(key: str, base: torch.nn.Module, lr: float, bucket_mb: int, ddp_kw: Dict[str, Any]) -> Peer:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    from funcopt.distributed import ZeroRedundancyOptimizer as FZero

    model = copy.deepcopy(base)
    if key == "ddp_adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    elif key in ("torch_zero", "torch_zero_bv"):
        opt = TorchZero(model.parameters(), optimizer_class=torch.optim.Adam,
                        parameters_as_bucket_view=(key == "torch_zero_bv"), lr=lr, fused=True)
    elif key in ("f_flat", "f_greedy", "f_flat_bv"):
        opt = FZero(model.parameters(), torch.optim.Adam, parameters_as_bucket_view=(key == "f_flat_bv"),
                    partition="greedy" if key == "f_greedy" else "flat", bucket_size_mb=bucket_mb, lr=lr)
    elif key in ("f_z2", "f_z2_bv"):
        opt = FZero(model.parameters(), torch.optim.Adam, zero_stage=2, bucket_size_mb=bucket_mb, lr=lr,
                    parameters_as_bucket_view=(key == "f_z2_bv"))
    else:
        raise ValueError(key)
    # DDP after the optimizer: bucket views replace p.data, DDP must see the final storage.
    net = model if key.startswith("f_z2") else DDP(model, **ddp_kw)
    return Peer(key, model, net, opt)


def train_step(peer: Peer, x: torch.Tensor, y: torch.Tensor, between: Optional[Callable[[], None]] = None) -> Tuple[float, float]:
    t0 = time.perf_counter()
    peer.opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(peer.net(x), y)
    loss.backward()
    t1 = time.perf_counter()
    if between is not None:
        between()
    t2 = time.perf_counter()
    peer.opt.step()
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


# ------------------------------------------------------------------ measurements
def comm_floors(n_params: int, world: int, bucket_mb: int, reps: int) -> Dict[str, Tuple[float, int]]:
    """Bare gloo collectives at this model's sizes: {what: (median seconds, bytes received per rank)}.

    ``P`` = all parameters, ``P/W`` = one rank's shard; "bucketed" cuts the
    shard into the same per-rank chunks as funcopt (``bucket_mb / W``).
    """
    shard = -(-n_params // world)
    per_rank = max(1, bucket_mb * MiB // world // 4)
    mine = torch.randn(shard)
    outs = list(torch.empty(world, shard).unbind(0))
    flat_out = torch.empty(world * shard)
    full = torch.randn(world * shard)
    rs_out = torch.empty(shard)
    gathered = (world - 1) * shard * 4
    rank = dist.get_rank()

    def ag_list() -> None:
        dist.all_gather(outs, mine)

    def ag_bucketed() -> None:
        for lo in range(0, shard, per_rank):
            hi = min(shard, lo + per_rank)
            dist.all_gather([o[lo:hi] for o in outs], mine[lo:hi].clone())

    def ag_single() -> None:
        dist.all_gather_into_tensor(flat_out, mine)

    def bcast() -> None:
        works = [dist.broadcast(outs[r][lo:lo + per_rank], src=r, async_op=True)
                 for lo in range(0, shard, per_rank) for r in range(world)]
        for w in works:
            w.wait()

    def p2p() -> None:
        ops = []
        for r in range(world):
            if r != rank:
                ops += [dist.P2POp(dist.isend, mine, r), dist.P2POp(dist.irecv, outs[r], r)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def allreduce() -> None:
        step = 25 * MiB // 4
        for lo in range(0, n_params, step):
            dist.all_reduce(full[lo:min(lo + step, n_params)])

    def reduce_scatter() -> None:
        for lo in range(0, shard, per_rank):
            hi = min(shard, lo + per_rank)
            dist.reduce_scatter_tensor(rs_out[lo:hi], torch.cat([full[r * shard + lo: r * shard + hi] for r in range(world)]))

    def reduce_owner() -> None:
        works = [dist.reduce(full[r * shard + lo: r * shard + min(shard, lo + per_rank)], dst=r, async_op=True)
                 for lo in range(0, shard, per_rank) for r in range(world)]
        for w in works:
            w.wait()

    cases = [
        ("all_gather, list outputs, 1 call (P/W per rank)", ag_list, gathered),
        ("all_gather, list outputs, bucketed like funcopt", ag_bucketed, gathered),
        ("all_gather_into_tensor, 1 call", ag_single, gathered),
        ("broadcast from each owner, bucketed, async", bcast, gathered),
        ("isend/irecv of the shard to every peer", p2p, gathered),
        ("all_reduce of P in 25 MiB buckets (DDP's traffic)", allreduce, n_params * 4),
        ("reduce_scatter_tensor of P, bucketed (ZeRO-2's traffic)", reduce_scatter, shard * 4),
        ("reduce of each P/W range to its owner, bucketed, async", reduce_owner, shard * 4),
    ]
    res: Dict[str, Tuple[float, int]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename notice
        for name, fn, nbytes in cases:
            ts = []
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            res[name] = (statistics.median(ts), nbytes)
    return res


def memcpy_floor(n_params: int, reps: int) -> float:
    a, b = torch.randn(n_params), torch.empty(n_params)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def step_breakdown(peers: List[Peer], batches: List[Tuple[torch.Tensor, torch.Tensor]], reps: int) -> Dict[str, Any]:
    """One profiler session over ``reps`` training steps of every peer.

    Each ``opt.step()`` runs inside a ``bench::step::<peer>`` range; every
    event (any thread: gloo runs its collectives on its own threads) that
    starts inside that range is charged to the peer's step.  Returns, per
    peer, {event name: (total ms, self ms, calls)} per step.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(reps):
            x, y = batches[k % len(batches)]
            for peer in peers:
                peer.opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(peer.net(x), y).backward()
                dist.barrier()
                with record_function(f"bench::step::{peer.key}"):
                    peer.opt.step()
    events = list(prof.events())
    windows = [(e.name[len("bench::step::"):], e.time_range.start, e.time_range.end)
               for e in events if e.name.startswith("bench::step::")]
    out: Dict[str, Dict[str, List[float]]] = {}
    for e in events:
        if e.name.startswith("bench::step::"):
            continue
        for key, lo, hi in windows:
            if lo <= e.time_range.start < hi:
                t = out.setdefault(key, {}).setdefault(e.name, [0.0, 0.0, 0])
                t[0] += e.cpu_time_total / 1e3
                t[1] += e.self_cpu_time_total / 1e3
                t[2] += 1
                break
    return {key: {n: (v[0] / reps, v[1] / reps, v[2] / reps) for n, v in rows.items()} for key, rows in out.items()}


def write_trace(peer: Peer, batches: List[Tuple[torch.Tensor, torch.Tensor]], out_dir: str, rank: int) -> None:
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    handler = tensorboard_trace_handler(out_dir, worker_name=f"{peer.key}_rank{rank}")
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=handler, with_stack=False) as prof:
        for k in range(5):
            x, y = batches[k % len(batches)]
            dist.barrier()
            train_step(peer, x, y)
            prof.step()



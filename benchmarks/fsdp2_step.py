"""FSDP2 optimizer step: funcopt (local shards through its kernels) vs torch.optim on DTensors.

Spawns W gloo CPU processes (default 2); each builds two FSDP2 models (``fully_shard``
per layer and at the root) and times ``opt.step()`` alone, the peers interleaved (one
step of each in turn, the same gradients every time):

* ``many-small``: 200 x ``Linear(64, 64)`` (400 DTensor parameters, 0.83 M elements);
* ``few-large``: 4 x ``Linear(1024, 1024)`` (8 parameters, 4.2 M elements).

Peers, per algorithm (``--algos``, default Adam): torch.optim default (``foreach=None``:
on DTensors torch picks foreach), ``foreach=True``, ``fused=True`` (where torch has a fused
CPU kernel), funcopt eager and funcopt scripted (``funcopt.script``).  Prints, per model,
the median step (slowest rank) with its min..max over repeats and each peer's ratio to
torch's default.  The parameters all peers reach are checked equal to torch's default
(rtol 1e-5) before timing.

    python benchmarks/fsdp2_step.py                       # W=2, Adam, 30 repeats
    python benchmarks/fsdp2_step.py --algos Adam,SGD --repeats 50
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

MODELS = {"many-small": (200, 64), "few-large": (4, 1024)}


def build(n: int, d: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(n)])


def peers(algo: str) -> Dict[str, Any]:
    import funcopt
    from funcopt.registry import REGISTRY

    spec = REGISTRY[algo]
    out: Dict[str, Any] = {
        "torch default": lambda ps: spec.torch_cls(ps, **spec.base),
        "torch foreach": lambda ps: spec.torch_cls(ps, foreach=True, **spec.base),
    }
    if "cpu" in spec.fused_devices:
        out["torch fused"] = lambda ps: spec.torch_cls(ps, fused=True, **spec.base)
    out["funcopt eager"] = lambda ps: spec.cls(ps, **spec.base)
    out["funcopt scripted"] = lambda ps: funcopt.script(spec.cls(ps, **spec.base))
    return out


def run_rank(rank: int, world: int, algos: List[str], repeats: int) -> Dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    results: Dict[str, Any] = {}
    for mname, (n, d) in MODELS.items():
        base = build(n, d)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(8, d, generator=g)
        for algo in algos:
            runs = {}
            for pname, make in peers(algo).items():
                model = copy.deepcopy(base)
                for layer in model:
                    fully_shard(layer)
                fully_shard(model)
                opt = make(list(model.parameters()))
                model(x).pow(2).mean().backward()  # gradients kept: every step sees the same ones
                runs[pname] = (model, opt)
            # warm up (state created, scripting compiled) and check every peer's numbers
            for _ in range(3):
                for model, opt in runs.values():
                    opt.step()
            ref = [p.full_tensor() for p in runs["torch default"][0].parameters()]
            for pname, (model, _) in runs.items():
                for a, b in zip(model.parameters(), ref):
                    torch.testing.assert_close(a.full_tensor(), b, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{mname} {algo} {pname}: {m}")
            times: Dict[str, List[float]] = {p: [] for p in runs}
            for _ in range(repeats):
                for pname, (_, opt) in runs.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    opt.step()
                    dt = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank
                    times[pname].append(dt.item() * 1e3)
            results[(mname, algo)] = times
    return results


def worker(rank: int, world: int, algos: List[str], repeats: int) -> Any:
    torch.set_num_threads(1)
    return run_rank(rank, world, algos, repeats)


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--algos", default="Adam")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    from funcopt.distributed.launch import launch

    res = launch(worker, args.world, args.algos.split(","), args.repeats, timeout=120, deadline=1200)
    if res.errors:
        for r, e in res.errors.items():
            print(f"rank {r}:\n{e}", file=sys.stderr)
        sys.exit(1)
    results = res.returns[0]
    print(f"FSDP2 optimizer step, W={args.world} gloo CPU, 1 thread per rank, {args.repeats} repeats; "
          f"ms, slowest rank: median (min..max); ratio = median / torch default's median")
    for (mname, algo), times in results.items():
        base = statistics.median(times["torch default"])
        print(f"\n{mname} ({MODELS[mname][0]} x Linear({MODELS[mname][1]}, {MODELS[mname][1]})), {algo}")
        print("| peer | median ms | min..max ms | / torch default |")
        print("|---|---|---|---|")
        for pname, ts in times.items():
            med = statistics.median(ts)
            print(f"| {pname} | {med:.2f} | {min(ts):.2f}..{max(ts):.2f} | {med / base:.3f}x |")


if __name__ == "__main__":
    main()

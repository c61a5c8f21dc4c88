#!/usr/bin/env python
"""The cache-blocked foreach fallback against the unblocked formula and torch's for-loop.

Where funcopt's native kernels are unavailable (``FUNCOPT_NATIVE=0``, set here
before funcopt is imported; or no C++ compiler), ``impl="auto"`` runs each
elementwise algorithm's foreach formula cache-blocked (``Core._blocked`` in
``funcopt/optimizers/_core.py``, ``BLOCK_BYTES`` per kernel call).  Per
algorithm, over the 16M-parameter model of ``benchmarks/step.py`` (63 float32
tensors), one intra-op thread, the peers interleaved::

    funcopt auto (blocked), eager and scripted
    funcopt impl="foreach" (one call per bucket: torch's foreach call sequence)
    torch.optim for-loop (foreach=False)

Each peer takes ``--warmup`` steps first (state allocation; RAdam's first
steps are its cheap unrectified ones in torch's for-loop), then ``--reps``
timed steps; prints the median wall time, the median CPU time of the stepping thread (with
one intra-op thread all the work runs on it: on a shared machine the CPU time leaves out the
time the process waited for a core) and each one's ratio to the for-loop's::

    python benchmarks/blocked_fallback.py [--algos RMSprop,NAdam] [--reps 5] [--block-kib 512,1024,2048]

``--block-kib``: instead of the four peers, funcopt auto eager at each block
size (KiB) next to impl="foreach" and the for-loop (how ``BLOCK_BYTES`` was chosen).
"""
import argparse
import os
import statistics
import time

os.environ["FUNCOPT_NATIVE"] = "0"

import torch  # noqa: E402

import funcopt  # noqa: E402
from funcopt.bench._step_parts import algo_info, case_shapes, make_tensors  # noqa: E402
from funcopt.optimizers import _core  # noqa: E402
from funcopt.registry import REGISTRY  # noqa: E402

ALGOS = "RMSprop,Adadelta,NAdam,Adamax,RAdam,ASGD,Rprop,Lion"


def peer(algo, kind, params, grads, block=None):
    spec = REGISTRY[algo]
    kw = algo_info(algo)["kw"]
    ps = [p.clone().requires_grad_() for p in params]
    if kind == "torch for-loop":
        opt = spec.torch_cls(ps, **spec.torch_flags(dict(kw, foreach=False)))
        for p, g in zip(ps, grads):
            p.grad = g
        return opt.step
    default = _core.BLOCK_BYTES
    if block is not None:
        _core.BLOCK_BYTES = block
    try:
        opt = spec.cls(ps, impl="foreach" if kind == "funcopt foreach" else "auto", **kw)
    finally:
        _core.BLOCK_BYTES = default
    assert not opt.uses_native
    if kind.endswith("scripted"):
        funcopt.script(opt)
    return lambda: opt.step(grads)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", default=ALGOS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--block-kib", default="")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shapes = case_shapes("16M")
    params = make_tensors(shapes, 0, 1.0)
    grads = make_tensors(shapes, 1, 0.01)
    n = sum(p.numel() for p in params)
    print(f"{len(shapes)} float32 tensors, {n:,} elements, {torch.get_num_threads()} thread(s), "
          f"BLOCK_BYTES={_core.BLOCK_BYTES}, medians of {a.reps} after {a.warmup} warm-up steps, "
          "wall and thread CPU ms, ratio to the for-loop")
    for algo in a.algos.split(","):
        if a.block_kib:
            peers = [(f"blocked {kib} KiB", "funcopt auto", int(kib) * 1024) for kib in a.block_kib.split(",")]
        else:
            peers = [("funcopt auto (blocked)", "funcopt auto", None),
                     ("funcopt auto (blocked) scripted", "funcopt auto scripted", None)]
        peers += [("funcopt foreach", "funcopt foreach", None), ("torch for-loop", "torch for-loop", None)]
        steps = {label: peer(algo, kind, params, grads, block) for label, kind, block in peers}
        with torch.no_grad():
            for _ in range(a.warmup):
                for step in steps.values():
                    step()
            wall = {label: [] for label in steps}
            cpu = {label: [] for label in steps}
            for _ in range(a.reps):
                for label, step in steps.items():
                    c0 = time.thread_time()
                    t0 = time.perf_counter()
                    step()
                    wall[label].append(time.perf_counter() - t0)
                    cpu[label].append(time.thread_time() - c0)
        w = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
        c = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
        rw, rc = w["torch for-loop"], c["torch for-loop"]
        print(f"{algo}: " + "; ".join(f"{k} {w[k]:.1f} {w[k] / rw:.2f}x cpu {c[k]:.1f} {c[k] / rc:.2f}x"
                                      for k in steps), flush=True)
        del steps


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""torch.compile time of one optimizer step: funcopt against torch.optim, per algorithm.

For every registry algorithm (or ``--algos``), in one process, interleaved
per algorithm: ``torch.compile(opt.step, fullgraph=...)`` of the funcopt
class and of the torch.optim class of the same name (its default
implementation on the CPU), each over the same small model's parameters;
the figure is the wall and CPU time of the first compiled call (trace +
graph compile + run) minus one eager step, and the time of a later compiled
step.  funcopt compiles with ``fullgraph=True`` (no graph breaks); torch.optim
with its own default (torch wraps parts of its step in
``torch.compiler.disable``, so ``fullgraph=True`` would fail there).

    python benchmarks/compile.py                       # every algorithm, inductor
    python benchmarks/compile.py --algos Adam,Lion --backend aot_eager
    python benchmarks/compile.py --markdown out.md     # also a Markdown table

Each case resets Dynamo's caches first.  Inductor builds C++ with the host
compiler: tens of seconds per case on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch

SHAPES = [(64, 32), (64,), (32, 64), (32,), (16, 16)]


def _params(seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _grads(params: List[torch.Tensor], t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _time(fn: Callable[[], Any]) -> Tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def compile_case(make: Callable[[List[torch.Tensor]], Any], fullgraph: bool, backend: str) -> Dict[str, float]:
    torch._dynamo.reset()
    eager_p, comp_p = _params(0), _params(0)
    eager, comp = make(eager_p), make(comp_p)
    _grads(eager_p, 0)
    eager_wall, _ = _time(eager.step)
    step = torch.compile(comp.step, fullgraph=fullgraph, backend=backend)
    _grads(comp_p, 0)
    first_wall, first_cpu = _time(step)
    later = []
    for t in range(1, 4):
        _grads(comp_p, t)
        later.append(_time(step)[0])
    return dict(compile_wall=first_wall - eager_wall, compile_cpu=first_cpu, step_ms=1e3 * statistics.median(later))


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", default="all", help="comma list of registry names, or 'all' (default)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default: %(default)s)")
    ap.add_argument("--markdown", default="", help="also write the table as Markdown to this file")
    args = ap.parse_args(argv)
    import funcopt
    from funcopt.registry import REGISTRY

    names = list(REGISTRY) if args.algos == "all" else [a.strip() for a in args.algos.split(",") if a.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        print(f"compile.py: unknown algorithm(s) {unknown}; choose from {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated")
    print(f"funcopt {funcopt.__version__}, torch {torch.__version__}, backend {args.backend}, "
          f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}")
    rows = []
    for name in names:
        spec = REGISTRY[name]
        shapes_ok = len(spec.probe_shape) < 2
        global SHAPES
        SHAPES = [(64, 32), (64,), (32, 64), (32,), (16, 16)] if shapes_ok else [(64, 32), (32, 64), (16, 16)]
        kw = dict(spec.rich)
        res = {}
        for who, make, full in (("funcopt", lambda ps: spec.cls(ps, **kw), True),
                                ("torch.optim", lambda ps: spec.torch_cls(ps, **kw), False)):
            try:
                res[who] = compile_case(make, full, args.backend)
            except Exception as e:  # report, do not stop the table
                res[who] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
        rows.append((name, res))
        f, t = res["funcopt"], res["torch.optim"]

        def fmt(r: Dict[str, Any]) -> str:
            if "error" in r:
                return r["error"]
            return f"{r['compile_wall']:.1f} s wall ({r['compile_cpu']:.1f} s CPU), step {r['step_ms']:.2f} ms"

        print(f"{name:<10} funcopt: {fmt(f)}  |  torch.optim: {fmt(t)}", flush=True)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("| algorithm | funcopt compile (wall / CPU s) | torch.optim compile (wall / CPU s) | ratio (wall) "
                     "| funcopt compiled step (ms) | torch.optim compiled step (ms) |\n|---|---|---|---|---|---|\n")
            for name, res in rows:
                f, t = res["funcopt"], res["torch.optim"]
                if "error" in f or "error" in t:
                    fh.write(f"| {name} | {f.get('error', '')} | {t.get('error', '')} | - | - | - |\n")
                    continue
                fh.write(f"| {name} | {f['compile_wall']:.1f} / {f['compile_cpu']:.1f} | {t['compile_wall']:.1f} / "
                         f"{t['compile_cpu']:.1f} | {f['compile_wall'] / t['compile_wall']:.2f}x | {f['step_ms']:.2f} | "
                         f"{t['step_ms']:.2f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

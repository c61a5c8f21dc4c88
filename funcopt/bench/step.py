"""Optimizer-step throughput: funcopt against the peers a user would pick instead.

One process, interleaved: for every (algorithm, size) case each peer gets its
own copy of the parameters and the same precomputed gradients, then every
repeat runs one step of every peer in turn (the starting peer rotates), so
drift in clock speed or background load hits all peers alike.  The figure is
the median of the per-step times.

Peers (where they exist for the algorithm):

* funcopt eager / scripted (``funcopt.script``), ``impl="foreach"`` / ``"fused"``
* ``torch.optim`` for-loop (``foreach=False``), ``foreach=True``, ``fused=True``
  (``p.grad`` is set once before timing; the gradients never change)
* torch's scripted functional optimizer
  (``torch.distributed.optim.functional_*``, ``torch.jit.script``-ed; it
  refuses foreach and fused, so it runs its single-tensor loop)
* ``aten fused (direct)``: the ATen fused kernel (and, for Adam/AdamW/Adagrad, the
  ``_foreach_add_`` of the step counters) called straight from Python on prebuilt
  lists; not a user's choice.  On large tensors it is the floor of any wrapper;
  on many small tensors it is not (Python converts every list argument, six
  lists of 2000 tensors here, on each call).

Also printed: the machine's measured memory bandwidth (``torch.add(out=)`` over
64M floats), effective GB/s of each step (bytes a step must move per parameter
/ time; 28 B for Adam: read p, g, m, v, write p, m, v), a breakdown of
funcopt's per-step overhead on many small tensors, and the GIL figure: two
Python threads each stepping their own optimizer, concurrently vs one after
the other.

Examples::

    funcopt bench step                  # the full run (a few minutes on 2 cores)
    funcopt bench step --quick          # smoke run (well under a minute)
    funcopt bench step --algos Adam --sizes 16M,tiny --repeats 30
    funcopt bench step --threads-only   # only the GIL figure
    funcopt bench step --profile --algos Adam --sizes tiny   # only TensorBoard traces, in runs/step
    funcopt bench step --quick --trace runs/step             # the tables, then traces into runs/step

``benchmarks/step.py`` is the same command as a script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

from ._report import print_summary, ratio_row

DEFAULT_SIZES = "1M,16M,64M,tiny"
def _algo_names() -> List[str]:
    from funcopt.registry import REGISTRY

    return list(REGISTRY)
# what `funcopt bench --quick` runs of this layer
QUICK = ("--quick", "--algos", "Adam", "--sizes", "1M,tiny", "--warmup", "2", "--gil-tensors", "500",
         "--peers", "script fused,torch.optim fused,functional script")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``funcopt bench step`` / ``benchmarks/step.py``."""
    ap.add_argument("--algos", default="all", help="comma list of registry names, or 'all' (default: %(default)s)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help="comma list of parameter counts (1M, 16M, 64M, ...) and/or 'tiny' "
                         "(2000 tensors of 1024) (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per peer (default: 15, 8 at >= 48M params)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per peer first (default: %(default)s)")
    ap.add_argument("--peers", default="", help="only peers whose name contains one of these (comma list)")
    ap.add_argument("--all-peers", action="store_true",
                    help="also run the eager funcopt and torch.optim for-loop peers at >= 48M params")
    ap.add_argument("--profile", action="store_true",
                    help="only write TensorBoard traces of scripted fused funcopt.Adam and torch.optim fused Adam")
    ap.add_argument("--profile-dir", default="runs/step")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="after the tables, write the torch.profiler traces (TensorBoard) into DIR")
    ap.add_argument("--threads-only", action="store_true", help="only the GIL (two Python threads) figure")
    ap.add_argument("--no-threads", action="store_true", help="skip the GIL figure")
    ap.add_argument("--gil-steps", type=int, default=20, help="steps per thread (default: %(default)s)")
    ap.add_argument("--gil-rounds", type=int, default=5, help="sequential/concurrent pairs (default: %(default)s)")
    ap.add_argument("--gil-tensors", type=int, default=2000,
                    help="tensors of 1024 floats per optimizer in the GIL figure (default: %(default)s)")
    ap.add_argument("--gil-intra-threads", default="1",
                    help="torch intra-op thread counts to run the GIL figure with (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for the tables (default: torch's own choice)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1M and tiny, few repeats")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ap.add_argument("--json", default="", help="also write all results to this JSON file")
    ap.add_argument("--markdown", default="", help="also write the tables as Markdown to this file")


def _size_ok(s: str) -> bool:
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", s, re.I)
    return s == "tiny" or (m is not None and float(m.group(1)) > 0)


def check(args: argparse.Namespace) -> Optional[str]:
    """The first bad option as one line (None: all fine); normalises the comma lists in place."""
    args.repeats_given = args.repeats is not None
    args.repeats = args.repeats if args.repeats is not None else 0
    if args.quick:
        if args.sizes == DEFAULT_SIZES:
            args.sizes = "1M,tiny"
        args.repeats = args.repeats or 3
        args.warmup = min(args.warmup, 2)
        args.gil_steps, args.gil_rounds = min(args.gil_steps, 5), 1
    for name in ("warmup", "threads"):
        if getattr(args, name) < 0:
            return f"--{name} must be at least 0, got {getattr(args, name)}"
    if args.repeats < 0 or (args.repeats == 0 and args.repeats_given):
        return f"--repeats must be at least 1, got {args.repeats}"
    for name in ("gil_steps", "gil_rounds", "gil_tensors"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    args.algos = _algo_names() if args.algos.strip() == "all" else [
        a.strip() for a in args.algos.split(",") if a.strip()]
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for a in args.algos:
        if a not in _algo_names():
            return f"--algos: unknown algorithm {a!r}; choose from {', '.join(_algo_names())}"
    if not args.algos or not args.sizes:
        return "--algos and --sizes need at least one entry"
    for s in args.sizes:
        if not _size_ok(s):
            return f"--sizes: {s!r} is not a parameter count (1M, 16M, 500K, 4096) or 'tiny'"
    try:
        args.gil_intra_threads = [int(t) for t in args.gil_intra_threads.split(",")]
    except ValueError:
        return f"--gil-intra-threads: {args.gil_intra_threads!r} is not a comma list of integers"
    if min(args.gil_intra_threads) < 1:
        return "--gil-intra-threads: every count must be at least 1"
    return None


def summary_rows(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Ratios per repeat (interleaved: repeat r of every peer ran back to back), with targets:
    scripted fused funcopt.Adam <= 1.05x torch.optim fused; >= 4x faster than torch's scripted
    functional optimizer at 16M; two threads >= 1.8x one (one intra-op thread)."""
    rows: List[Dict[str, Any]] = []
    for c in results.get("cases", []):
        t = c.get("times_s", {})
        sf, tf, fs = (t.get(k) for k in ("funcopt script fused", "torch.optim fused", "torch functional script"))
        name = f"{c['algo']} {c['size']}"
        if sf and tf:
            rows.append(ratio_row("step", f"{name}: script fused / torch.optim fused",
                                  [a / b for a, b in zip(sf, tf)], 1.05, "lower"))
        if sf and fs:
            target = 4.0 if c["size"] == "16M" else None
            rows.append(ratio_row("step", f"{name}: torch functional script / script fused",
                                  [a / b for a, b in zip(fs, sf)], target, "higher"))
        # issue 11's targets, for every algorithm: funcopt's scripted step (fused
        # where torch has the kernel) against torch.optim's fastest implementation
        # of the same algorithm, and against torch's scripted functional twin
        ours_name = "funcopt script fused" if "funcopt script fused" in t else "funcopt script foreach"
        ours = t.get(ours_name)
        med = c.get("median_s", {})
        theirs = [k for k in ("torch.optim fused", "torch.optim foreach", "torch.optim for-loop") if k in t]
        if ours and theirs:
            best = min(theirs, key=lambda k: med.get(k, float("inf")))
            target = 1.0 if c["size"] == "16M" else 0.7 if c["size"] == "tiny" else None
            rows.append(ratio_row("step", f"{name}: {ours_name} / {best} (fastest torch.optim)",
                                  [a / b for a, b in zip(ours, t[best])], target, "lower"))
        if ours and fs and ours_name != "funcopt script fused":
            rows.append(ratio_row("step", f"{name}: torch functional script / {ours_name}",
                                  [a / b for a, b in zip(fs, ours)], 2.5 if c["size"] == "16M" else None,
                                  "higher"))
    for r in results.get("gil", []):
        if r["kind"] == "funcopt script fused":
            rows.append(ratio_row("step", f"GIL: 2 threads / 1, scripted fused Adam, set_num_threads("
                                          f"{r['intra_threads']})", r["speedups"],
                                  1.8 if r["intra_threads"] == 1 else None, "higher"))
    return rows


def run(args: argparse.Namespace) -> int:
    """The benchmark (``args`` as parsed and :func:`check`-ed); prints the tables and the summary."""
    problem = check(args) if isinstance(args.algos, str) else None  # called without check()
    if problem:
        print(f"funcopt bench step: {problem}", file=sys.stderr)
        return 2
    import torch
    from tqdm import tqdm

    import funcopt

    from . import _step_extra as extra
    from ._step_parts import measure_bandwidth, parse_size, run_case

    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    print(f"funcopt {funcopt.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{cpu}, {os.cpu_count()} CPUs, torch intra-op threads {torch.get_num_threads()}, "
          f"load avg {os.getloadavg()[0]:.2f}")
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"WARNING: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: other processes are "
              "running; figures (tiny tensors and the GIL figure above all) will be noisy; --threads 1 is "
              "steadier on a busy machine (see docs/benchmarks.md)")
    results: Dict[str, Any] = dict(torch=torch.__version__, cpu=cpu, cpus=os.cpu_count(),
                                   intra_threads=torch.get_num_threads(), argv=sys.argv[1:], cases=[])
    t_start = time.perf_counter()
    if args.profile:
        extra.profile(args)
        return 0
    bw_numel = 16 * 2**20 if args.quick else 64 * 2**20
    if not args.threads_only:
        bws: List[Dict[str, float]] = []

        def bandwidth(when: str) -> float:
            bwd = measure_bandwidth(bw_numel, 5 if args.quick else 10)
            bwd["loadavg"] = os.getloadavg()[0]
            bws.append(bwd)
            best = max(b["inplace_best"] for b in bws)
            print(f"\nmemory bandwidth ({when}; {bw_numel // 2**20}M fp32, GB/s best/median): a.add_(b) "
                  f"{bwd['inplace_best']:.1f}/{bwd['inplace_median']:.1f} (12 B/elem); torch.add(out=) "
                  f"{bwd['add_best']:.1f}/{bwd['add_median']:.1f} (12 B/elem); copy_ {bwd['copy_best']:.1f}/"
                  f"{bwd['copy_median']:.1f} (8 B/elem); load avg {bwd['loadavg']:.2f}. %BW is against the best "
                  f"a.add_(b) so far, {best:.1f} GB/s.")
            return best

        cases = [(size, algo) for size in args.sizes for algo in args.algos]
        bar = tqdm(total=len(cases), desc="step cases", unit="case", file=sys.stderr, disable=args.no_progress)
        bw = 0.0
        for i, (size, algo) in enumerate(cases):
            if i == 0 or cases[i - 1][0] != size:
                bw = bandwidth(f"before {size}")
            bar.set_postfix_str(f"{algo} {size}")
            results["cases"].append(run_case(algo, size, args, bw))
            bar.update()
        bar.close()
        results["bandwidth"] = bws
        bandwidth("after the tables")
        if "Adam" in args.algos and any(parse_size(s) < 0 for s in args.sizes) and not args.quick:
            results["overhead"] = extra.overhead_breakdown(args)
    if not args.no_threads:
        results["gil"] = extra.gil_figure(args)
        results["gil_tensors"] = args.gil_tensors
    if args.trace:
        extra.profile(args, args.trace)
    rows = summary_rows(results)
    args.summary_rows = rows
    print_summary(rows, title="funcopt bench step: summary (median ratio over repeats, min-max; a target is met "
                              "only when the whole spread meets it)")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s, load avg now {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(extra.render_markdown(results) + "\n")
        print(f"tables written to {args.markdown}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``benchmarks/step.py``: the same as ``funcopt bench step``."""
    from . import main_layer

    return main_layer("step", sys.argv[1:] if argv is None else argv, prog=os.path.basename(sys.argv[0]) or None)

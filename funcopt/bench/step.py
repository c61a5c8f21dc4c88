"""Optimizer-step throughput: funcopt against the peers a user would pick instead.

One process, interleaved: for every (algorithm, size) case each peer gets its
own copy of the parameters and the same precomputed gradients, then every
repeat runs one step of every peer in turn (the starting peer rotates), so
drift in clock speed or background load hits all peers alike.  The figure is
the median of the per-step times.

Peers (where they exist for the algorithm):

* funcopt scripted (``funcopt.script``) and eager with the default
  ``impl="auto"`` (the native one-pass rule for SGD, RMSprop, Adamax, Adadelta,
  NAdam, RAdam, ASGD, Rprop and Lion; torch's fused kernel for Adam, AdamW
  and Adagrad; the foreach formula for Adafactor and Muon), and scripted
  ``impl="foreach"`` (the fallback where no compiler exists; algorithms with a
  native rule only unless ``--all-peers``)
* funcopt compiled: ``torch.compile(opt.step, fullgraph=True)`` of the default
  eager optimizer
* ``torch.optim`` for-loop (``foreach=False``), ``foreach=True``, ``fused=True``
  (``p.grad`` is set once before timing; the gradients never change), and
  compiled: ``torch.compile(opt.step)`` of the default ``torch.optim``
  optimizer (torch's recipe).  Compiled peers are warmed up (three calls:
  trace, compile, the recompile once state exists) before timing; that
  compile time is printed as a note, never counted in a step.  They do not
  run at the tiny size unless ``--compile-sizes`` names it (compiling over
  2000 tensors takes many minutes), nor with ``--no-compile``
* torch's scripted functional optimizer
  (``torch.distributed.optim.functional_*``, ``torch.jit.script``-ed; it
  refuses foreach and fused, so it runs its single-tensor loop)
* ``aten fused (direct)``: the ATen fused kernel (and, for Adam/AdamW/Adagrad, the
  ``_foreach_add_`` of the step counters) called straight from Python on prebuilt
  lists; not a user's choice.  On large tensors it is the floor of any wrapper;
  on many small tensors it is not (Python converts every list argument, six
  lists of 2000 tensors here, on each call).
* ``matmul floor (NS shapes)`` (Muon only, always run): the matmuls of Muon's
  Newton-Schulz iterations alone, the same shapes and count in bfloat16
  (``ns_steps`` x ``X @ X.T``, ``G @ G``, ``G @ X`` per matrix).  Muon's limit
  is this floor, not the memory limit; each Muon case also prints the FLOP
  count (``ns_steps x (4 m^2 n + 2 m^3)`` per matrix, ``m <= n``), the floor's
  GFLOP/s and the machine's ``1024^3`` bfloat16/float32 ``torch.mm`` rate.

Also printed: the machine's measured memory bandwidth (``torch.add(out=)`` over
64M floats, before each size at each thread count), effective GB/s of each
step and its ratio to the one-pass limit (bytes a step must move per parameter
element x elements / the bandwidth; 28 B for Adam: read p, g, m, v, write p,
m, v; every algorithm's in :mod:`funcopt.bench._step_limits`), issue 21's
summary table per (algorithm, size, threads) with its target verdicts, the
native library's first-use cost, a breakdown of funcopt's per-step overhead
on many small tensors, and the GIL figure: two Python threads each stepping
their own optimizer, concurrently vs one after the other, per ``--gil-algos``
algorithm, against the same two-thread run of a pure TorchScript workload
(the machine's ceiling).

Examples::

    funcopt bench step                  # the full run (an hour or more on 2 cores: every
                                        # algorithm, peer and size; cut it with --algos,
                                        # --sizes, --threads, --peers, --no-compile)
    funcopt bench step --quick          # smoke run (well under a minute)
    funcopt bench step --algos Adam --sizes 16M,tiny --repeats 30
    funcopt bench step --algos RMSprop,Adam --sizes tiny,1M --threads 1,all --no-compile
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
         "--peers", "funcopt script,torch.optim fused,functional script", "--no-compile")


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
                    help="also run torch's scripted functional optimizers at >= 48M params, and funcopt "
                         "script foreach for algorithms without a native rule")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the compiled peers (funcopt compiled, torch.optim compiled)")
    ap.add_argument("--compile-sizes", default="",
                    help="sizes at which the compiled peers run (comma list, or 'all'; default: every size "
                         "but tiny)")
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
    ap.add_argument("--gil-algos", default="Adam",
                    help="algorithms of the GIL figure, each with its default scripted optimizer (comma list "
                         "or 'all'; default: %(default)s)")
    ap.add_argument("--threads", default="0",
                    help="torch.set_num_threads for the tables: a count, or a comma list run one after the "
                         "other ('all' = every CPU; e.g. 1,all); 0: torch's own choice (default)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1M and tiny, few repeats, no compiled peers unless --compile-sizes")
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
    if args.warmup < 0:
        return f"--warmup must be at least 0, got {args.warmup}"
    if isinstance(args.threads, str):
        try:
            args.threads = [(os.cpu_count() or 1) if t.strip() == "all" else int(t)
                            for t in args.threads.split(",") if t.strip()]
        except ValueError:
            return f"--threads: {args.threads!r} is not a count or a comma list of counts and 'all'"
    if isinstance(args.threads, int):  # a caller's Namespace from before the list
        args.threads = [args.threads]
    if not args.threads or min(args.threads) < 0:
        return f"--threads must be at least 0, got {args.threads}"
    if args.repeats < 0 or (args.repeats == 0 and args.repeats_given):
        return f"--repeats must be at least 1, got {args.repeats}"
    for name in ("gil_steps", "gil_rounds", "gil_tensors"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    args.algos = _algo_names() if args.algos.strip() == "all" else [
        a.strip() for a in args.algos.split(",") if a.strip()]
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    cs = getattr(args, "compile_sizes", "")
    args.compile_sizes = args.sizes if cs.strip() == "all" else [s.strip() for s in cs.split(",") if s.strip()]
    # --quick: no compiled peers unless --compile-sizes asks for them (a compile takes 10-40 s)
    args.no_compile = getattr(args, "no_compile", False) or (args.quick and not cs.strip())
    ga = getattr(args, "gil_algos", "Adam")
    args.gil_algos = _algo_names() if ga.strip() == "all" else [a.strip() for a in ga.split(",") if a.strip()]
    for a in args.algos + args.gil_algos:
        if a not in _algo_names():
            which = "--algos" if a in args.algos else "--gil-algos"
            return f"{which}: unknown algorithm {a!r}; choose from {', '.join(_algo_names())}"
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
    """Ratios per repeat (interleaved: repeat r of every peer ran back to back), with targets.

    Issue 21 (:func:`funcopt.bench._step_limits.verdict_rows`): funcopt's default scripted step
    <= 1.3x the one-pass limit (elementwise rules, 16M/64M); <= 0.5x torch.optim's fastest eager
    implementation (<= 1.0x where torch has a fused kernel; <= 0.5x for all at tiny); funcopt
    compiled <= 1.0x min(torch.optim compiled, funcopt eager).  Issue 11: torch's scripted
    functional optimizer >= 4x (fused kernel) / >= 2.5x slower at 16M; two Python threads
    >= 1.8x one (one intra-op thread), and that speedup against the machine's ceiling."""
    from ._step_limits import OURS, verdict_rows

    rows: List[Dict[str, Any]] = verdict_rows(results)
    for c in results.get("cases", []):
        t = c.get("times_s", {})
        ours, fs = t.get(OURS), t.get("torch functional script")
        if ours and fs:
            fused = c.get("impl") == "fused"
            target = (4.0 if fused else 2.5) if c["size"] == "16M" else None
            rows.append(ratio_row("step", f"{c['algo']} {c['size']}, {c.get('threads', 0)} thr: torch functional "
                                          f"script / {OURS}", [a / b for a, b in zip(fs, ours)], target, "higher"))
    for r in results.get("gil", []):
        if r["kind"] == "funcopt script":
            what = f"GIL: scripted {r['algo']} ({r.get('impl', '')}), set_num_threads({r['intra_threads']})"
            rows.append(ratio_row("step", f"{what}: 2 threads / 1", r["speedups"],
                                  1.8 if r["intra_threads"] == 1 else None, "higher"))
            if r.get("vs_ceiling"):
                rows.append(ratio_row("step", f"{what}: its 2-thread speedup / the scripted ceiling's",
                                      r["vs_ceiling"], None, "higher"))
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
    from . import _step_limits as limits
    from ._step_parts import measure_bandwidth, parse_size, run_case

    default_threads = torch.get_num_threads()
    thread_counts = [t or default_threads for t in args.threads]
    torch.set_num_threads(thread_counts[0])
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    load0 = os.getloadavg()
    print(f"funcopt {funcopt.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{cpu}, {os.cpu_count()} CPUs, torch intra-op threads {', '.join(map(str, thread_counts))}, "
          f"load avg at start {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f} (1 / 5 / 15 min)")
    if load0[0] > 0.5 * (os.cpu_count() or 1):
        print(f"WARNING: load average {load0[0]:.2f} on {os.cpu_count()} CPUs: other processes are "
              "running; figures (tiny tensors and the GIL figure above all) will be noisy; --threads 1 is "
              "steadier on a busy machine (see docs/benchmarks.md)")
    results: Dict[str, Any] = dict(torch=torch.__version__, cpu=cpu, cpus=os.cpu_count(),
                                   intra_threads=thread_counts, argv=sys.argv[1:], cases=[], loadavg_start=load0)
    results["native"] = extra.first_use_cost()
    t_start = time.perf_counter()
    if args.profile:
        extra.profile(args)
        return 0
    bw_numel = 16 * 2**20 if args.quick else 64 * 2**20
    if not args.threads_only:
        bws: List[Dict[str, float]] = []

        def bandwidth(when: str, threads: int) -> float:
            bwd = measure_bandwidth(bw_numel, 5 if args.quick else 10)
            bwd["loadavg"] = os.getloadavg()[0]
            bwd["threads"] = threads
            bws.append(bwd)
            best = max(b["inplace_best"] for b in bws if b["threads"] == threads)
            print(f"\nmemory bandwidth ({when}; {threads} thread(s); {bw_numel // 2**20}M fp32, GB/s best/median): "
                  f"a.add_(b) {bwd['inplace_best']:.1f}/{bwd['inplace_median']:.1f} (12 B/elem); torch.add(out=) "
                  f"{bwd['add_best']:.1f}/{bwd['add_median']:.1f} (12 B/elem); copy_ {bwd['copy_best']:.1f}/"
                  f"{bwd['copy_median']:.1f} (8 B/elem); load avg {bwd['loadavg']:.2f}. %BW and the limit are "
                  f"against the best a.add_(b) so far at {threads} thread(s), {best:.1f} GB/s.")
            return best

        cases = [(threads, size, algo) for threads in thread_counts for size in args.sizes for algo in args.algos]
        bar = tqdm(total=len(cases), desc="step cases", unit="case", file=sys.stderr, disable=args.no_progress)
        bw = 0.0
        for i, (threads, size, algo) in enumerate(cases):
            torch.set_num_threads(threads)
            if i == 0 or cases[i - 1][:2] != (threads, size):
                bw = bandwidth(f"before {size}", threads)
            bar.set_postfix_str(f"{algo} {size} {threads}T")
            results["cases"].append(run_case(algo, size, args, bw))
            bar.update()
        bar.close()
        results["bandwidth"] = bws
        for threads in thread_counts:
            torch.set_num_threads(threads)
            bandwidth("after the tables", threads)
        torch.set_num_threads(thread_counts[0])
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
    limits.print_table(results)
    load1 = os.getloadavg()
    results["loadavg_end"] = load1
    results["wall_s"] = time.perf_counter() - t_start
    print(f"\nfirst-use cost: {results['native']['line']}")
    print(f"load avg at start {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}, at the end {load1[0]:.2f} / "
          f"{load1[1]:.2f} / {load1[2]:.2f} (1 / 5 / 15 min, {os.cpu_count()} CPUs)")
    print(f"total wall time {results['wall_s']:.0f} s")
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

"""Profiles of the step benchmark's misses (issue 21): where the time of each goes.

    python benchmarks/profile_misses.py                     # every section, defaults below
    python benchmarks/profile_misses.py --sections compute --algos Rprop,Adamax,RAdam
    python benchmarks/profile_misses.py --trace-dir runs/misses   # + TensorBoard traces

Three sections, each a torch.profiler run (TensorBoard traces with ``--trace-dir``) plus
the timings that explain it; one intra-op thread unless ``--threads`` says otherwise:

``compute``   a native rule at a large size: the share of the step spent in the one
              ``funcopt::step_`` call, and that rule's cost per element when its tensors
              sit in cache (the slope between two in-cache sizes, so per-call costs drop
              out) against the memory budget per element (bytes one pass moves / the
              measured ``a.add_(b)`` bandwidth).  compute / memory near 1 means the loop's
              arithmetic, not DRAM, sets the pace.
``overhead``  2000 tensors of 1k: the scripted step, its kernel call(s) and the rest (the
              TorchScript core: validating and splitting the gradients, the step counters).
``compiled``  ``torch.compile(opt.step)`` against the eager step: Dynamo's guard check
              ("TorchDynamo Cache Lookup"), AOTAutograd's runtime prologue, the compiled
              graph's own Python (argument unpacking, size/stride asserts) and the kernel.

Run it on an idle machine (it prints the load average); the figures are shares and
per-element costs, less sensitive to load than the step benchmark's ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import funcopt
import funcopt.native
from funcopt.bench._report import quiet_profiler
from funcopt.bench._step_limits import per_element_bytes
from funcopt.bench._step_parts import algo_info, case_shapes, interleaved, make_tensors, measure_bandwidth


def _load() -> str:
    try:
        return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unavailable"


def _median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    return statistics.median(interleaved([fn], warmup, repeats)[0]) * 1e3


def _profile(fns: Dict[str, Callable[[], Any]], n: int, trace_dir: Optional[str], name: str) -> Any:
    """Profile ``n`` calls of each function (one after another); write a trace if asked."""
    from torch.profiler import ProfilerActivity, record_function, tensorboard_trace_handler

    kw: Dict[str, Any] = {"activities": [ProfilerActivity.CPU]}
    if trace_dir:
        kw["on_trace_ready"] = tensorboard_trace_handler(trace_dir, worker_name=name)
    with quiet_profiler(), torch.profiler.profile(**kw) as prof:
        for label, fn in fns.items():
            with record_function(f"funcopt::profile/{name}/{label}"):
                for _ in range(n):
                    fn()
    return prof


def _keys(prof: Any) -> Dict[str, Any]:
    return {e.key: e for e in prof.key_averages()}


def _opt(algo: str, params: List[torch.Tensor], scripted: bool = True) -> Any:
    opt = getattr(funcopt, algo)(params, **algo_info(algo)["kw"])
    return funcopt.script(opt) if scripted else opt


# --------------------------------------------------------------------------- compute
def compute(algos: List[str], size: str, repeats: int, trace_dir: Optional[str]) -> None:
    bw = max(measure_bandwidth(16 * 2**20, 8)["inplace_best"], 1e-9)
    print(f"\n== compute: native rules at {size}, one pass vs the rule's in-cache cost "
          f"(a.add_(b): {bw:.1f} GB/s; {_load()})")
    print(f"{'algorithm':<10}{'step ms':>9}{'op share':>10}{'in-cache ns/el':>16}{'memory ns/el':>14}"
          f"{'compute/memory':>16}{'step ns/el':>12}")
    shapes = case_shapes(size)
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    for algo in algos:
        cls = getattr(funcopt, algo)
        if getattr(cls, "native_rule", None) is None:
            print(f"{algo:<10} has no native rule: skipped")
            continue
        grads = make_tensors(shapes, 1, 1.0)
        opt = _opt(algo, make_tensors(shapes, 0, 0.02))
        if not opt.uses_native:
            print(f"{algo:<10} not on its native rule here (no compiler?): skipped")
            continue
        step = lambda: opt.step(grads)  # noqa: E731
        step()
        t_step = _median_ms(step, repeats)
        prof = _profile({"step": step}, 3, trace_dir, f"compute-{algo}-{size}")
        ka = _keys(prof)
        op = ka.get("funcopt::step_")
        total = sum(e.self_cpu_time_total for e in ka.values() if not e.key.startswith("funcopt::profile/"))
        share = (op.cpu_time_total / total) if (op is not None and total > 0) else float("nan")
        # in-cache slope: two sizes that fit the caches, same tensor count, so the per-call
        # and per-tensor costs cancel in the difference
        per: List[float] = []
        for n_el in (8 * 1024, 64 * 1024):
            ps = make_tensors([(n_el,)] * 4, 0, 0.02)
            gs = make_tensors([(n_el,)] * 4, 1, 1.0)
            o = _opt(algo, ps)
            o.step(gs)
            per.append(min(interleaved([lambda o=o, gs=gs: o.step(gs)], 20, max(repeats, 50))[0]))
        slope_ns = (per[1] - per[0]) / (4 * (64 - 8) * 1024) * 1e9
        mem_ns = per_element_bytes(algo, algo_info(algo)["kw"]) / bw
        print(f"{algo:<10}{t_step:>9.2f}{share:>10.0%}{slope_ns:>16.3f}{mem_ns:>14.3f}"
              f"{slope_ns / mem_ns:>15.2f}x{t_step * 1e6 / numel:>12.3f}")
    print("op share: the funcopt::step_ call's share of the profiled step (the rest: the scripted core);"
          " step ns/el over memory ns/el is the step's ratio to the one-pass limit.")


# --------------------------------------------------------------------------- overhead
def overhead(algos: List[str], repeats: int, trace_dir: Optional[str]) -> None:
    shapes = case_shapes("tiny")
    print(f"\n== overhead: {len(shapes)} tensors of {shapes[0][0]}, scripted step ({_load()})")
    for algo in algos:
        grads = make_tensors(shapes, 1, 1.0)
        opt = _opt(algo, make_tensors(shapes, 0, 0.02))
        opt.step(grads)
        slots = opt._core.slots  # benchmark-only look inside: the scripted core's Slots
        tparams = make_tensors(shapes, 0, 0.02)
        topt = getattr(torch.optim, algo)(tparams, **algo_info(algo)["kw"],
                                          **({"fused": True} if algo in ("SGD", "Adam", "AdamW", "Adagrad") else {}))
        for p, g in zip(tparams, grads):
            p.grad = g
        parts: Dict[str, Callable[[], Any]] = {
            "funcopt opt.step (scripted)": lambda: opt.step(grads),
            "  slots.select (validate + split the gradients)": lambda: slots.select(grads),
            "torch.optim (fused where torch has it)": topt.step,
        }
        times = interleaved(list(parts.values()), 3, repeats)
        prof = _profile({"step": lambda: opt.step(grads)}, 5, trace_dir, f"overhead-{algo}")
        ka = _keys(prof)
        kernels = [k for k in ka if k in ("funcopt::step_", "aten::_fused_sgd_", "aten::_fused_adam_",
                                          "aten::_fused_adamw_", "aten::_fused_adagrad_")]
        total = sum(e.self_cpu_time_total for e in ka.values() if not e.key.startswith("funcopt::profile/"))
        kern = sum(ka[k].cpu_time_total for k in kernels)
        print(f"{algo}:")
        for (label, _), ts in zip(parts.items(), times):
            print(f"  {label:<50}{statistics.median(ts) * 1e3:>9.3f} ms (min {min(ts) * 1e3:.3f})")
        if total > 0:
            print(f"  profiled step: kernel ({', '.join(kernels) or 'none'}) {kern / total:.0%}, "
                  f"the rest (TorchScript core, counters) {1 - kern / total:.0%}")


# --------------------------------------------------------------------------- compiled
_COMPILED_KEYS = ("TorchDynamo Cache Lookup", "AOTDispatcher Runtime Wrapper Prologue", "Pregraph bytecode")


def compiled(algos: List[str], size: str, repeats: int, trace_dir: Optional[str]) -> None:
    shapes = case_shapes(size)
    print(f"\n== compiled: torch.compile(opt.step) vs the eager step, {size} ({len(shapes)} tensors; {_load()})")
    for algo in algos:
        params = make_tensors(shapes, 0, 0.02)
        for p, g in zip(params, make_tensors(shapes, 1, 1.0)):
            p.requires_grad_()
            p.grad = g
        opt = getattr(funcopt, algo)(params, **algo_info(algo)["kw"])
        opt.step()
        t0 = time.perf_counter()
        cstep = torch.compile(opt.step, fullgraph=True)
        for _ in range(3):
            cstep()
        t_compile = time.perf_counter() - t0
        te, tc = interleaved([opt.step, cstep], 3, repeats)
        prof = _profile({"compiled": cstep}, 20, trace_dir, f"compiled-{algo}-{size}")
        ka = _keys(prof)
        n = 20
        rows = {k: ka[k].self_cpu_time_total / n for k in _COMPILED_KEYS if k in ka}
        graph = [e for k, e in ka.items() if k.startswith("## Call CompiledFxGraph")]
        if graph:
            rows["compiled graph's own Python (args, asserts)"] = sum(e.self_cpu_time_total for e in graph) / n
        kern = [e for k, e in ka.items() if k == "funcopt::step_" or k.startswith("aten::_fused_")
                or k.startswith("funcopt_aten::")]
        rows["kernel op(s)"] = sum(e.cpu_time_total for e in kern) / n
        n_tensors = len(params)
        print(f"{algo}: eager {statistics.median(te) * 1e3:.3f} ms, compiled {statistics.median(tc) * 1e3:.3f} ms "
              f"({statistics.median(tc) / statistics.median(te):.2f}x eager; compile {t_compile:.1f} s; "
              f"{n_tensors} parameters)")
        for k, v in rows.items():
            print(f"  {k:<50}{v / 1e3:>9.3f} ms per call")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="compute,overhead,compiled")
    ap.add_argument("--algos", default="Rprop,Adamax,RAdam,RMSprop", help="compute section")
    ap.add_argument("--overhead-algos", default="SGD,RMSprop,Adam")
    ap.add_argument("--compiled-algos", default="RMSprop,Adam,ASGD")
    ap.add_argument("--size", default="16M", help="compute section's size")
    ap.add_argument("--compiled-size", default="1M")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trace-dir", default=None, help="write TensorBoard traces here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} intra-op thread(s), funcopt's native library: "
          f"{'loaded' if funcopt.native.available() else 'unavailable (foreach formulas)'}")
    sections = args.sections.split(",")
    if "compute" in sections:
        compute(args.algos.split(","), args.size, args.repeats, args.trace_dir)
    if "overhead" in sections:
        overhead(args.overhead_algos.split(","), args.repeats, args.trace_dir)
    if "compiled" in sections:
        compiled(args.compiled_algos.split(","), args.compiled_size, args.repeats, args.trace_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

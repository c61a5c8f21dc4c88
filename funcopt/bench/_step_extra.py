"""The extra figures of ``funcopt bench step``: funcopt's per-step overhead on many small
tensors, the GIL figure, profiler traces and the Markdown tables (see :mod:`funcopt.bench.step`)."""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

import funcopt
from funcopt.script import quiet_jit

from ._report import quiet_profiler
from ._step_parts import (TINY_COUNT, TINY_NUMEL, Step, algo_info, aten_peer, case_shapes, impl_note, interleaved,
                          make_tensors, no_gc, peers_for)

# --------------------------------------------------------------------------- overhead
try:  # funcopt internals, only for the overhead breakdown
    from funcopt._slots import Slots
except ImportError:  # pragma: no cover
    Slots = None  # type: ignore[assignment,misc]


def _probe_noop(grads: List[Optional[torch.Tensor]]) -> int:
    return len(grads)


def _probe_kernel(s: Slots, grads: List[torch.Tensor]) -> None:
    lists = s.full[0]
    torch._fused_adam_(lists[0], grads, lists[2], lists[3], [], lists[1], lr=1e-3, beta1=0.9, beta2=0.999,
                       weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


def _scripted_probes() -> Tuple[Any, Any]:
    """TorchScript functions that time pieces of funcopt's scripted fused Adam step
    on its own cached bucket lists (``Slots.full[0]``: params, step, exp_avg, exp_avg_sq)."""
    with quiet_jit():  # torch's notice only, where we script
        return torch.jit.script(_probe_noop), torch.jit.script(_probe_kernel)


def overhead_breakdown(args: argparse.Namespace) -> Dict[str, float]:
    """Where a scripted fused funcopt Adam step on 2000 x 1024 goes."""
    shapes = case_shapes("tiny")
    grads = make_tensors(shapes, 1, 1.0)
    opt = funcopt.script(funcopt.Adam(make_tensors(shapes, 0, 0.02), impl="fused"))
    opt.step(grads)
    core = opt._core
    slots = core.slots
    floor, _ = aten_peer("Adam")(make_tensors(shapes, 0, 0.02), grads)
    parts: Dict[str, Step] = {
        "opt.step (Python wrapper + scripted core)": lambda: opt.step(grads),
        "core.step (scripted core only)": lambda: core.step(grads, None, None),
        "opt._sync_hyper (Python, per step)": opt._sync_hyper,
        "slots.select(grads) (validate + split)": lambda: slots.select(grads),
    }
    try:
        noop, kernel = _scripted_probes()
        parts.update({
            "scripted no-op(grads) (list conversion)": lambda: noop(grads),
            "scripted _fused_adam_ on the cached lists": lambda: kernel(slots, grads),
        })
    except Exception as e:  # funcopt internals moved: keep the rest
        print(f"note: scripted probes unavailable ({type(e).__name__}: {e})")
    parts["same two ops from Python (aten fused (direct))"] = floor
    times = interleaved(list(parts.values()), 2, max(args.repeats or 15, 15))
    out = {k: statistics.median(t) for k, t in zip(parts, times)}
    print(f"\nPer-step overhead, scripted fused funcopt.Adam, {TINY_COUNT} x {TINY_NUMEL} fp32 "
          f"(median and min ms; per tensor in us)")
    for (k, t), ts in zip(out.items(), times):
        print(f"  {k:<48}{t * 1e3:>9.3f} ms{min(ts) * 1e3:>9.3f} ms{t / TINY_COUNT * 1e6:>8.2f} us")
    # inside the real step (the profiler inflates every op a little; read it as shares)
    n = 5
    with quiet_profiler(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            core.step(grads, None, None)
    ka = {e.key: e for e in prof.key_averages()}
    total = sum(e.self_cpu_time_total for e in ka.values())
    shares = {
        "aten::_fused_adam_ (the kernel)": ka["aten::_fused_adam_"].cpu_time_total if "aten::_fused_adam_" in ka else 0,
        "aten::_foreach_add_ (step counters, 2000 add_)":
            ka["aten::_foreach_add_"].cpu_time_total if "aten::_foreach_add_" in ka else 0,
    }
    shares["TorchScript interpreter (select, lists, loop)"] = total - sum(shares.values())
    print(f"  inside core.step, torch.profiler over {n} steps ({total / n / 1e3:.2f} ms/step profiled):")
    for k, v in shares.items():
        print(f"    {k:<48}{v / n / 1e3:>9.3f} ms {100 * v / total:>5.1f}%")
        out["profiled: " + k] = v / n / 1e6
    return out


# --------------------------------------------------------------------------- first use
def first_use_cost() -> Dict[str, Any]:
    """Load funcopt's native library now (building it where this torch + sources + CPU have
    none yet) and describe what that cost: :func:`funcopt.native.status` plus the file size."""
    from funcopt import native

    t0 = time.perf_counter()
    native.load()
    st = dict(native.status(), load_call_s=time.perf_counter() - t0)
    path = st["path"]
    st["bytes"] = os.path.getsize(path) if os.path.exists(path) else None
    if st["error"] or not st["loaded"]:
        st["line"] = (f"native library unavailable (mode {st['mode']}): {st['error'] or 'not loaded'}; "
                      "the native algorithms run their foreach formulas")
    else:
        how = "built (compiler) and loaded" if st["built_now"] else "loaded from the cache"
        st["line"] = (f"native library {how} in {st['seconds'] or 0.0:.3f} s ({st['load_call_s']:.3f} s for "
                      f"funcopt.native.load() in this process), {path}, {st['bytes']:,} bytes")
    print(f"first-use cost: {st['line']}")
    return st


# --------------------------------------------------------------------------- GIL
def _ceiling_loop(ps: List[torch.Tensor], gs: List[torch.Tensor]) -> None:
    for i in range(len(ps)):
        ps[i].mul_(0.999).add_(gs[i], alpha=1e-3)


def _seq_con(a: Step, b: Step, n: int) -> Tuple[float, float, float, float]:
    """Seconds for ``n`` calls of ``a`` then ``n`` of ``b`` in this thread, then both at once in
    two threads; with the CPU/wall of each."""
    def loop(f: Step) -> None:
        for _ in range(n):
            f()

    c0, t0 = time.process_time(), time.perf_counter()
    loop(a)
    loop(b)
    t_seq = time.perf_counter() - t0
    u_seq = (time.process_time() - c0) / t_seq
    barrier = threading.Barrier(3)

    def worker(f: Step) -> None:
        barrier.wait()
        loop(f)

    ths = [threading.Thread(target=worker, args=(f,)) for f in (a, b)]
    for t in ths:
        t.start()
    barrier.wait()
    c0, t0 = time.process_time(), time.perf_counter()
    for t in ths:
        t.join()
    t_con = time.perf_counter() - t0
    return t_seq, t_con, u_seq, (time.process_time() - c0) / t_con


def gil_figure(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Two Python threads, each stepping its own optimizer over ``--gil-tensors`` x 1024 floats:
    per ``--gil-algos`` algorithm its default scripted optimizer (for Adam also the eager one
    and torch.optim fused), each round paired with the same two-thread run of a pure
    TorchScript loop over as many tensors (``ceiling``: what two threads give on this machine
    when no thread holds the GIL) and the controls."""
    shapes = [(TINY_NUMEL,)] * args.gil_tensors
    ceiling_fn: Any = None
    impl = ""

    def make(kind: str, algo: str) -> Step:
        nonlocal ceiling_fn, impl
        if kind.startswith("control: torch.mm"):
            a = torch.randn(512, 512)
            return lambda: [torch.mm(a, a) for _ in range(3)]
        if kind.startswith("control: Python"):
            return lambda: sum(range(300_000))
        from funcopt.registry import REGISTRY

        shp = [REGISTRY[algo].param_shape(x) for x in shapes] if algo else shapes  # Muon: matrices
        params = make_tensors(shp, 0, 0.02)
        grads = make_tensors(shp, 1, 1.0)
        if kind == "ceiling":
            if ceiling_fn is None:
                with quiet_jit():
                    ceiling_fn = torch.jit.script(_ceiling_loop)
            fn = ceiling_fn
            step: Step = lambda: fn(params, grads)  # noqa: E731
        elif kind.startswith("funcopt"):
            opt = getattr(funcopt, algo)(params, **algo_info(algo)["kw"])
            impl = impl_note(opt)
            if "script" in kind:
                opt = funcopt.script(opt)
            step = lambda: opt.step(grads)  # noqa: E731
        else:
            for p, g in zip(params, grads):
                p.requires_grad_().grad = g
            step = torch.optim.Adam(params, fused=True).step
        step()
        return step

    n = args.gil_steps
    kinds = [("funcopt script", a) for a in args.gil_algos]
    if "Adam" in args.gil_algos:
        kinds += [("funcopt eager", "Adam"), ("torch.optim fused", "Adam")]
    kinds += [("control: torch.mm (no GIL)", ""), ("control: Python (GIL)", "")]
    rows = []
    old = torch.get_num_threads()
    for threads in args.gil_intra_threads:
        torch.set_num_threads(threads)
        print(f"\nGIL figure: 2 Python threads x {n} steps each over {len(shapes)} x {TINY_NUMEL} fp32, "
              f"torch.set_num_threads({threads}); median of {args.gil_rounds} rounds, each round sequential then "
              f"concurrent, then the same for the ceiling (a TorchScript loop p.mul_().add_(g) over as many "
              f"tensors: two threads that never hold the GIL)")
        print(f"  {'optimizer':<34}{'1 thread ms/step':>17}{'sequential s':>14}{'concurrent s':>14}{'speedup':>9}"
              f"{'ceiling':>9}{'/ceiling':>9}{'CPU/wall seq':>14}{'CPU/wall conc':>15}")
        for kind, algo in kinds:
            impl = ""
            a, b = make(kind, algo), make(kind, algo)
            ca, cb = make("ceiling", ""), make("ceiling", "")
            seq, con, ratio, ceil, vs, util_seq, util_con = [], [], [], [], [], [], []
            with no_gc():
                for _ in range(args.gil_rounds):
                    t_seq, t_con, u_seq, u_con = _seq_con(a, b, n)
                    c_seq, c_con, _, _ = _seq_con(ca, cb, n)
                    seq.append(t_seq)
                    con.append(t_con)
                    ratio.append(t_seq / t_con)
                    ceil.append(c_seq / c_con)
                    vs.append(ratio[-1] / ceil[-1])
                    util_seq.append(u_seq)
                    util_con.append(u_con)
            label = f"{kind} {algo}".strip() + (f" ({impl})" if impl else "")
            row = dict(kind=kind, algo=algo, impl=impl, label=label, intra_threads=threads, steps=n,
                       rounds=args.gil_rounds, seq_s=statistics.median(seq), con_s=statistics.median(con),
                       speedup=statistics.median(ratio), speedups=ratio, ceiling=statistics.median(ceil),
                       ceilings=ceil, vs_ceiling=vs, cpu_per_wall_seq=statistics.median(util_seq),
                       cpu_per_wall_con=statistics.median(util_con), loadavg=os.getloadavg())
            rows.append(row)
            print(f"  {label:<34}{row['seq_s'] / (2 * n) * 1e3:>17.2f}{row['seq_s']:>14.3f}{row['con_s']:>14.3f}"
                  f"{row['speedup']:>8.2f}x{row['ceiling']:>8.2f}x{statistics.median(vs):>8.2f}x"
                  f"{row['cpu_per_wall_seq']:>14.2f}{row['cpu_per_wall_con']:>15.2f}"
                  f"   (rounds: {', '.join(f'{r:.2f}' for r in ratio)}; load avg {row['loadavg'][0]:.1f})")
            del a, b, ca, cb
    torch.set_num_threads(old)
    return rows


# --------------------------------------------------------------------------- profile
def profile(args: argparse.Namespace, logdir: Optional[str] = None) -> None:
    """TensorBoard traces (``tensorboard_trace_handler``) of scripted funcopt.Adam (its default: fused) and torch.optim
    fused Adam, one per size, into ``logdir`` (default ``args.profile_dir``)."""
    from torch.profiler import ProfilerActivity, record_function, schedule, tensorboard_trace_handler

    logdir = logdir or args.profile_dir
    for size in args.sizes:
        shapes = case_shapes(size)
        grads = make_tensors(shapes, 1, 1.0)
        built = []
        for name, build in peers_for("Adam"):
            if name in ("funcopt script", "torch.optim fused"):
                step, why = build(make_tensors(shapes, 0, 0.02), grads)
                if step is not None:
                    step()
                    built.append((name, step))
        active = 3
        with quiet_profiler(), torch.profiler.profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(logdir, worker_name=f"adam-{size}"),
        ) as prof:
            for i in range(1 + active):
                for name, step in built:
                    with record_function(f"funcopt::bench/Adam/{size}/{name.replace(' ', '-')}"):
                        step()
                prof.step()
        del built
    files = sorted(os.path.join(logdir, f) for f in os.listdir(logdir)) if os.path.isdir(logdir) else []
    print(f"\nProfile: TensorBoard traces in {os.path.abspath(logdir)}/ "
          f"(view: tensorboard --logdir {logdir}, PyTorch Profiler tab)")
    for f in files:
        print(f"  {f}  ({os.path.getsize(f) / 1e6:.1f} MB)")


# --------------------------------------------------------------------------- markdown
def render_markdown(results: Dict[str, Any]) -> str:
    """The tables of a run (or of its --json file) as Markdown: issue 21's summary, then one
    table per (size, threads) with every peer's ms/step and ratio to the one-pass limit, the
    GIL figure and the run's first-use cost and load averages."""
    from . import _step_limits as limits

    lines: List[str] = []
    cases = results.get("cases", [])
    native = results.get("native", {})
    if native.get("line"):
        lines += [f"First-use cost: {native['line']}.", ""]
    l0, l1 = results.get("loadavg_start"), results.get("loadavg_end")
    if l0 and l1:
        lines += [f"Load average (1 / 5 / 15 min) at start {l0[0]:.2f} / {l0[1]:.2f} / {l0[2]:.2f}, at the end "
                  f"{l1[0]:.2f} / {l1[1]:.2f} / {l1[2]:.2f}, {results.get('cpus')} CPUs.", ""]
    summary = limits.markdown(results)
    if summary:
        lines += [summary]
    groups: List[Tuple[str, int]] = []
    for c in cases:
        key = (c["size"], c.get("threads", 0))
        if key not in groups:
            groups.append(key)
    for size, threads in groups:
        row = [c for c in cases if (c["size"], c.get("threads", 0)) == (size, threads)]
        first = row[0]
        bw = limits.best_bandwidth(results, threads)
        lines.append(f"**{size}, {threads} intra-op thread(s)**: {first['numel']:,} params in {first['tensors']} "
                     f"tensors; median ms/step and x = / the one-pass limit (B/elem x params / {bw:.1f} GB/s, the "
                     f"run's best a.add_(b) at {threads} thread(s)), load avg {first['loadavg'][0]:.1f}, process got "
                     f"{first['cpu_per_wall']:.2f} CPUs")
        lines.append("")
        lines.append("| peer | " + " | ".join(f"{c['algo']} ms | x" for c in row) + " |")
        lines.append("|---|" + "---:|---:|" * len(row))
        lines.append("| B/elem (limit ms) | " + " | ".join(
            f"{c['bytes_per_param']:.1f} | ({c['bytes_per_param'] * c['numel'] / (bw * 1e9) * 1e3:.2f})" if bw
            else f"{c['bytes_per_param']:.1f} | -" for c in row) + " |")
        peers: List[str] = []
        for c in row:
            peers += [p for p in c["median_s"] if p not in peers]
        for p in peers:
            cells = []
            for c in row:
                t = c["median_s"].get(p)
                lim = c["bytes_per_param"] * c["numel"] / (bw * 1e9) if bw else 0.0
                cells.append(f"{t * 1e3:.2f} | {t / lim:.2f}" if t and lim
                             else (f"{t * 1e3:.2f} | -" if t else "- | -"))
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        skipped = sorted({n.split(":")[0] for c in row for n in c["notes"] if "skipped" in n or "not run" in n})
        if skipped:
            lines.append("")
            lines.append(f"Not run at this size: {', '.join(skipped)} (see the notes of the run).")
        compiles = [f"{c['algo']} {n}" for c in row for n in c["notes"] if " compiled: compiled (" in n]
        if compiles:
            lines.append("")
            lines.append("Compile time (not in the step times): " + "; ".join(compiles) + ".")
        lines.append("")
    gil = results.get("gil", [])
    if gil:
        lines.append(f"**GIL figure**: 2 Python threads x {gil[0]['steps']} steps over {results.get('gil_tensors')} "
                     f"x {TINY_NUMEL} fp32, median of {gil[0]['rounds']} rounds; ceiling: the same two-thread run "
                     "of a TorchScript loop (no GIL held), paired per round")
        lines.append("")
        lines.append("| optimizer | intra-op threads | 1 thread ms/step | speedup | ceiling | / ceiling |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for r in gil:
            vs = statistics.median(r["vs_ceiling"]) if r.get("vs_ceiling") else 0.0
            lines.append(f"| {r.get('label', r['kind'])} | {r['intra_threads']} | "
                         f"{r['seq_s'] / (2 * r['steps']) * 1e3:.2f} | {r['speedup']:.2f}x | "
                         f"{r.get('ceiling', 0):.2f}x | {vs:.2f}x |")
        lines.append("")
    return "\n".join(lines)

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
from ._step_parts import (TINY_COUNT, TINY_NUMEL, Step, aten_peer, case_shapes, interleaved, make_tensors, no_gc,
                          peers_for)

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


# --------------------------------------------------------------------------- GIL
def gil_figure(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Two Python threads, each stepping its own optimizer over 2000 x 1024 floats."""
    shapes = [(TINY_NUMEL,)] * args.gil_tensors

    def make(kind: str) -> Step:
        if kind.startswith("control: torch.mm"):
            a = torch.randn(512, 512)
            return lambda: [torch.mm(a, a) for _ in range(3)]
        if kind.startswith("control: Python"):
            return lambda: sum(range(300_000))
        params = make_tensors(shapes, 0, 0.02)
        grads = make_tensors(shapes, 1, 1.0)
        if kind.startswith("funcopt"):
            opt = funcopt.Adam(params, impl="fused")
            if "script" in kind:
                opt = funcopt.script(opt)
            step: Step = lambda: opt.step(grads)  # noqa: E731
        else:
            for p, g in zip(params, grads):
                p.requires_grad_().grad = g
            step = torch.optim.Adam(params, fused=True).step
        step()
        return step

    n = args.gil_steps
    rows = []
    old = torch.get_num_threads()
    for threads in args.gil_intra_threads:
        torch.set_num_threads(threads)
        print(f"\nGIL figure: 2 Python threads x {n} Adam steps each over {len(shapes)} x {TINY_NUMEL} fp32, "
              f"torch.set_num_threads({threads}); median of {args.gil_rounds} rounds, "
              f"each round sequential then concurrent")
        print(f"  {'optimizer':<27}{'1 thread ms/step':>17}{'sequential s':>14}{'concurrent s':>14}{'speedup':>9}"
              f"{'CPU/wall seq':>14}{'CPU/wall conc':>15}")
        for kind in ("funcopt script fused", "funcopt eager fused", "torch.optim fused",
                     "control: torch.mm (no GIL)", "control: Python (GIL)"):
            a, b = make(kind), make(kind)

            def loop(f: Step) -> None:
                for _ in range(n):
                    f()

            seq, con, ratio, util_seq, util_con = [], [], [], [], []
            with no_gc():
                for _ in range(args.gil_rounds):
                    c0, t0 = time.process_time(), time.perf_counter()
                    loop(a)
                    loop(b)
                    t_seq = time.perf_counter() - t0
                    util_seq.append((time.process_time() - c0) / t_seq)
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
                    util_con.append((time.process_time() - c0) / t_con)
                    seq.append(t_seq)
                    con.append(t_con)
                    ratio.append(t_seq / t_con)
            row = dict(kind=kind, intra_threads=threads, steps=n, rounds=args.gil_rounds,
                       seq_s=statistics.median(seq), con_s=statistics.median(con),
                       speedup=statistics.median(ratio), speedups=ratio, cpu_per_wall_seq=statistics.median(util_seq),
                       cpu_per_wall_con=statistics.median(util_con), loadavg=os.getloadavg())
            rows.append(row)
            print(f"  {kind:<27}{row['seq_s'] / (2 * n) * 1e3:>17.2f}{row['seq_s']:>14.3f}{row['con_s']:>14.3f}"
                  f"{row['speedup']:>8.2f}x{row['cpu_per_wall_seq']:>14.2f}{row['cpu_per_wall_con']:>15.2f}"
                  f"   (rounds: {', '.join(f'{r:.2f}' for r in ratio)}; load avg {row['loadavg'][0]:.1f})")
            del a, b
    torch.set_num_threads(old)
    return rows


# --------------------------------------------------------------------------- profile
def profile(args: argparse.Namespace, logdir: Optional[str] = None) -> None:
    """TensorBoard traces (``tensorboard_trace_handler``) of scripted fused funcopt.Adam and torch.optim
    fused Adam, one per size, into ``logdir`` (default ``args.profile_dir``)."""
    from torch.profiler import ProfilerActivity, record_function, schedule, tensorboard_trace_handler

    logdir = logdir or args.profile_dir
    for size in args.sizes:
        shapes = case_shapes(size)
        grads = make_tensors(shapes, 1, 1.0)
        built = []
        for name, build in peers_for("Adam"):
            if name in ("funcopt script fused", "torch.optim fused"):
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
    """The tables of a run (or of its --json file) as Markdown, one table per size."""
    lines: List[str] = []
    cases = results.get("cases", [])
    bw = max((b["inplace_best"] for b in results.get("bandwidth", [])), default=0.0)
    sizes: List[str] = []
    for c in cases:
        if c["size"] not in sizes:
            sizes.append(c["size"])
    for size in sizes:
        row = [c for c in cases if c["size"] == size]
        first = row[0]
        lines.append(f"**{size}**: {first['numel']:,} params in {first['tensors']} tensors; median ms/step "
                     f"(x = / torch.optim fused), load avg {first['loadavg'][0]:.1f}, process got "
                     f"{first['cpu_per_wall']:.2f} CPUs")
        lines.append("")
        lines.append("| peer | " + " | ".join(f"{c['algo']} ms | x" for c in row) + " |")
        lines.append("|---|" + "---:|---:|" * len(row))
        peers: List[str] = []
        for c in row:
            peers += [p for p in c["median_s"] if p not in peers]
        for p in peers:
            cells = []
            for c in row:
                t, tf = c["median_s"].get(p), c["median_s"].get("torch.optim fused")
                cells.append(f"{t * 1e3:.2f} | {t / tf:.2f}" if t and tf else (f"{t * 1e3:.2f} | -" if t else "- | -"))
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        skipped = sorted({n.split(":")[0] for c in row for n in c["notes"] if "skipped" in n})
        if skipped:
            lines.append("")
            lines.append(f"Not run at this size (time): {', '.join(skipped)}.")
        lines.append("")
    adam = [c for c in cases if c["algo"] == "Adam"]
    if adam and bw:
        lines.append(f"**Adam, effective bandwidth** (28 B/param / median step time; reference: best "
                     f"`a.add_(b)` {bw:.1f} GB/s)")
        lines.append("")
        lines.append("| size | funcopt script fused GB/s | % of ref | torch.optim fused GB/s | % of ref |")
        lines.append("|---|---:|---:|---:|---:|")
        for c in adam:
            sf, tf = c["median_s"].get("funcopt script fused"), c["median_s"].get("torch.optim fused")
            g1 = 28 * c["numel"] / sf / 1e9 if sf else 0.0
            g2 = 28 * c["numel"] / tf / 1e9 if tf else 0.0
            lines.append(f"| {c['size']} | {g1:.1f} | {100 * g1 / bw:.0f}% | {g2:.1f} | {100 * g2 / bw:.0f}% |")
        lines.append("")
    return "\n".join(lines)


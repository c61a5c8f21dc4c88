"""The cases, the peers and the interleaved timing of ``funcopt bench step`` (see :mod:`funcopt.bench.step`)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import inspect
import math
import os
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import funcopt
from funcopt.script import quiet_jit

from ._step_limits import NS_FLOOR, NS_FLOP_FORMULA, ns_dims, ns_flops, per_element_bytes, traffic

Step = Callable[[], Any]

# --------------------------------------------------------------------------- cases
# hand-picked settings for the algorithms with an ATen fused kernel; every
# other registry algorithm is benchmarked with its registry ``base`` settings
_KNOWN: Dict[str, Dict[str, Any]] = {
    # name: hyperparameters (torch.optim kwargs)
    "Adam": dict(kw=dict(lr=1e-3)),
    "AdamW": dict(kw=dict(lr=1e-3, weight_decay=1e-2)),
    "SGD": dict(kw=dict(lr=1e-2, momentum=0.9)),
    "Adagrad": dict(kw=dict(lr=1e-2)),
}


def algo_info(algo: str) -> Dict[str, Any]:
    """``kw`` (hyperparameters), ``bytes`` (one pass's memory traffic per fp32
    parameter: read p and g, write p, read and write each per-element state
    tensor these hyperparameters turn on; 28 for Adam; a case's exact figure,
    per-tensor scalars and factored state included, is
    :func:`funcopt.bench._step_limits.traffic`) and ``functional`` (torch's
    scripted functional twin, if torch has one)."""
    from funcopt.registry import REGISTRY

    spec = REGISTRY[algo]
    info = dict(_KNOWN.get(algo, {}))
    info.setdefault("kw", dict(spec.base))
    info["bytes"] = per_element_bytes(algo, info["kw"])
    info["functional"] = (f"functional_{algo.lower()}", f"_Functional{algo}")
    return info


DEFAULT_SIZES = "1M,16M,64M,tiny"
TINY_COUNT, TINY_NUMEL = 2000, 1024
# peers left out at or above this many parameters unless --all-peers (time, not memory;
# torch's scripted functional twin runs torch's for-loop formula, which is measured)
HEAVY_PEERS = ("torch functional script",)
HEAVY_NUMEL = 48 * 2**20


def parse_size(s: str) -> int:
    s = s.strip()
    if s == "tiny":
        return -1
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1].upper(), 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def transformer_shapes(target: int) -> List[Tuple[int, ...]]:
    """Shapes of a small transformer summing to ~``target`` fp32 params.

    Per layer: qkv [3d,d]+[3d], out [d,d]+[d], 2 layernorms [d]x2, MLP
    [4d,d]+[4d], [d,4d]+[d]; an embedding [V,d] takes up the remainder and a
    final layernorm closes it.
    """
    d = 128 if target < 4 * 2**20 else 512 if target < 32 * 2**20 else 1024 if target < 256 * 2**20 else 2048
    layer = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    per = sum(math.prod(s) for s in layer)
    n_layers = max(1, (target - 2 * d) // per)
    rows = max(1, (target - n_layers * per - 2 * d) // d)
    return [(rows, d)] + layer * n_layers + [(d,), (d,)]


def case_shapes(size: str) -> List[Tuple[int, ...]]:
    n = parse_size(size)
    return [(TINY_NUMEL,)] * TINY_COUNT if n < 0 else transformer_shapes(n)


def make_tensors(shapes: Sequence[Tuple[int, ...]], seed: int, scale: float) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).mul_(scale) for s in shapes]


def fmt_numel(n: int) -> str:
    return f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n / 2**10:.0f}K"


# --------------------------------------------------------------------------- peers
def impl_note(opt: Any) -> str:
    """What ``impl='auto'`` runs for ``opt`` on these (CPU float32) parameters."""
    if opt.uses_native:
        return "native"
    return "fused" if "cpu" in type(opt).fused_devices and opt.impl != "foreach" else "foreach"


def funcopt_peer(algo: str, impl: str, scripted: bool) -> Callable[..., Tuple[Optional[Step], str]]:
    """funcopt's optimizer, ``impl`` ("auto": the default), eager or ``funcopt.script``-ed.
    On success the second value is a note (what ``impl="auto"`` runs)."""
    def build(params: List[torch.Tensor], grads: List[torch.Tensor]) -> Tuple[Optional[Step], str]:
        cls = getattr(funcopt, algo, None)
        if cls is None:
            return None, f"funcopt.{algo} does not exist (yet) in this checkout"
        if impl == "fused" and "cpu" not in cls.fused_devices:
            return None, f"torch has no fused CPU kernel for {algo}"
        opt = cls(params, impl=impl, **algo_info(algo)["kw"])
        note = f"impl='auto' runs {impl_note(opt)}" if impl == "auto" and scripted else ""
        if scripted:
            opt = funcopt.script(opt)
        return (lambda: opt.step(grads)), note

    return build


def compiled(fn: Callable[..., Any], args: Tuple[Any, ...], fullgraph: bool, calls: int = 3) -> Tuple[Step, str]:
    """``torch.compile(fn)``, called ``calls`` times (trace, compile, the recompile once the
    first step made state); the step and a note with that compile time, which the timed steps
    do not include.  ``fullgraph`` falls back to graph breaks where tracing one graph fails."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    w0, c0 = time.perf_counter(), time.process_time()
    how = "fullgraph" if fullgraph else "graph breaks allowed"
    cfn = torch.compile(fn, fullgraph=fullgraph)
    try:
        cfn(*args)
    except Exception as e:  # torch._dynamo.exc.Unsupported and friends
        if not fullgraph:
            raise
        how = f"fullgraph failed ({type(e).__name__}: {str(e).splitlines()[0][:80]}), graph breaks allowed"
        cfn = torch.compile(fn)
        cfn(*args)
    for _ in range(calls - 1):
        cfn(*args)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    graphs = counters["stats"]["unique_graphs"] - graphs0
    note = (f"compiled ({how}, {graphs} graph(s)) in {wall:.1f} s wall / {cpu:.1f} s CPU over its first "
            f"{calls} calls; not in the step times")
    return (lambda: cfn(*args)), note


def funcopt_compiled_peer(algo: str) -> Callable[..., Tuple[Optional[Step], str]]:
    """``torch.compile(opt.step, fullgraph=True)`` of the default eager funcopt optimizer."""
    def build(params: List[torch.Tensor], grads: List[torch.Tensor]) -> Tuple[Optional[Step], str]:
        cls = getattr(funcopt, algo, None)
        if cls is None:
            return None, f"funcopt.{algo} does not exist (yet) in this checkout"
        opt = cls(params, **algo_info(algo)["kw"])
        return compiled(opt.step, (grads,), True)

    return build


def torch_peer(algo: str, mode: str) -> Callable[..., Tuple[Optional[Step], str]]:
    """torch.optim's ``mode``: "loop" (foreach=False), "foreach", "fused", or "compiled":
    ``torch.compile(opt.step)`` of the default optimizer with the gradients set (torch's recipe)."""
    def build(params: List[torch.Tensor], grads: List[torch.Tensor]) -> Tuple[Optional[Step], str]:
        leaves = [p.requires_grad_() for p in params]
        for p, g in zip(leaves, grads):
            p.grad = g  # shared, read-only for these hyperparameters (checked after timing)
        flags = dict(foreach=False, fused=False) if mode == "loop" else {} if mode == "compiled" else {mode: True}
        try:
            from funcopt.registry import REGISTRY

            accepted = inspect.signature(REGISTRY[algo].torch_cls.__init__).parameters
            if any(v and k not in accepted for k, v in flags.items()):
                return None, f"torch.optim.{algo} has no {mode} implementation"
            flags = {k: v for k, v in flags.items() if k in accepted}
            opt = REGISTRY[algo].torch_cls(leaves, **algo_info(algo)["kw"], **flags)
        except (RuntimeError, ValueError, TypeError) as e:
            return None, f"torch.optim.{algo}({mode}=True) refused: {e}"
        if mode == "compiled":
            return compiled(opt.step, (), False)
        return opt.step, ""

    return build


@contextlib.contextmanager
def quiet_functional_deprecation() -> Any:
    """Drop torch's "TorchScript support for functional optimizers is deprecated"
    (torch forces it with simplefilter("always"), so a filter cannot stop it)."""
    orig = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "functional optimizers is deprecated" not in str(message):
            orig(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = orig


def functional_peer(algo: str) -> Callable[..., Tuple[Optional[Step], str]]:
    def build(params: List[torch.Tensor], grads: List[torch.Tensor]) -> Tuple[Optional[Step], str]:
        mod, name = algo_info(algo)["functional"]
        try:
            with quiet_functional_deprecation(), quiet_jit():  # torch's notices, where we script
                cls = getattr(importlib.import_module("torch.distributed.optim." + mod), name)
                f = torch.jit.script(cls(params, **algo_info(algo)["kw"]))
        except Exception as e:  # not built with distributed, or not scriptable here
            return None, f"torch.distributed.optim.{mod}.{name} unavailable: {type(e).__name__}: {e}"
        glist: List[Optional[torch.Tensor]] = list(grads)
        return (lambda: f.step(glist)), ""

    return build


def aten_peer(algo: str) -> Callable[..., Tuple[Optional[Step], str]]:
    """The ATen fused kernel called directly from Python on prebuilt lists."""

    def build(params: List[torch.Tensor], grads: List[torch.Tensor]) -> Tuple[Optional[Step], str]:
        kw = algo_info(algo)["kw"]
        z = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
        steps = [torch.zeros(()) for _ in params]
        one = torch.ones(())  # the one-tensor overload, as funcopt and torch.optim bump CPU step counters
        if algo in ("Adam", "AdamW"):
            m, v = z(), z()
            op = torch._fused_adamw_ if algo == "AdamW" else torch._fused_adam_
            wd = kw.get("weight_decay", 0.0)

            def step() -> None:
                torch._foreach_add_(steps, one, alpha=1.0)
                op(params, grads, m, v, [], steps, lr=kw["lr"], beta1=0.9, beta2=0.999, weight_decay=wd,
                   eps=1e-8, amsgrad=False, maximize=False)
        elif algo == "SGD":
            buf = z()

            def step() -> None:
                torch._fused_sgd_(params, grads, buf, weight_decay=0.0, momentum=kw["momentum"], lr=kw["lr"],
                                  dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
        elif algo == "Adagrad":
            sums = z()

            def step() -> None:
                torch._foreach_add_(steps, one, alpha=1.0)
                torch._fused_adagrad_(params, grads, sums, steps, lr=kw["lr"], lr_decay=0.0, weight_decay=0.0,
                                      eps=1e-10, maximize=False)
        else:
            return None, f"no direct fused kernel wired up for {algo}"
        return step, ""

    return build


def ns_steps_of(algo: str) -> int:
    """Newton-Schulz iterations per step in the benchmark's settings (Muon's default 5)."""
    from funcopt.optimizers.muon import NS_STEPS

    return int(algo_info(algo)["kw"].get("ns_steps", NS_STEPS))


def ns_floor_peer(algo: str) -> Callable[..., Tuple[Optional[Step], str]]:
    """Muon's FLOP floor: only the matmuls of its Newton-Schulz iterations, the same shapes and
    dtype (bfloat16, as torch.optim.Muon and funcopt run them) and count, called straight from
    Python: per matrix, ``ns_steps`` x (``X @ X.T``, ``G @ G``, ``G @ X``), ``X`` ``m x n`` with
    ``m <= n`` (:func:`funcopt.bench._step_limits.ns_dims`).  Timed in the same interleaved
    repeats as the optimizers, it is what the machine's matmul needs for the step's FLOPs."""
    def build(params: List[torch.Tensor], grads: List[torch.Tensor]) -> Tuple[Optional[Step], str]:
        ns = ns_steps_of(algo)
        gen = torch.Generator().manual_seed(2)
        mats = []
        for p in params:
            m, n = ns_dims(p.shape)
            x = torch.randn(m, n, generator=gen).div_(math.sqrt(m * n)).to(torch.bfloat16)  # ||X||_F ~ 1
            mats.append((x, torch.mm(x, x.t())))

        def step() -> None:
            for x, gm in mats:
                for _ in range(ns):
                    torch.mm(x, x.t())
                    torch.mm(gm, gm)
                    torch.mm(gm, x)

        return step, (f"{ns} x 3 bfloat16 torch.mm per matrix ({NS_FLOP_FORMULA}); the peers' 'x floor' below "
                      "divide by its time")

    return build


def peak_matmul(n: int = 1024, repeats: int = 5) -> Dict[str, float]:
    """The machine's matmul rate at the current intra-op thread count: best GFLOP/s of an
    ``n x n x n`` ``torch.mm`` in bfloat16 and float32 (``2 n^3`` FLOPs each)."""
    out: Dict[str, float] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            ts.append(time.perf_counter() - t0)
        out[name] = 2.0 * n ** 3 / min(ts) / 1e9
    return out


COMPILED_PEERS = ("funcopt compiled", "torch.optim compiled")


def peers_for(algo: str) -> List[Tuple[str, Callable[..., Tuple[Optional[Step], str]]]]:
    """Every peer of ``algo``, funcopt's default (impl="auto") first."""
    return [
        ("funcopt script", funcopt_peer(algo, "auto", True)),
        ("funcopt eager", funcopt_peer(algo, "auto", False)),
        ("funcopt compiled", funcopt_compiled_peer(algo)),
        ("funcopt script foreach", funcopt_peer(algo, "foreach", True)),
        ("torch.optim for-loop", torch_peer(algo, "loop")),
        ("torch.optim foreach", torch_peer(algo, "foreach")),
        ("torch.optim fused", torch_peer(algo, "fused")),
        ("torch.optim compiled", torch_peer(algo, "compiled")),
        ("torch functional script", functional_peer(algo)),
        ("aten fused (direct)", aten_peer(algo)),
        (NS_FLOOR, ns_floor_peer(algo)),
    ]


def skip_reason(name: str, algo: str, size: str, numel: int, args: argparse.Namespace) -> str:
    """Why peer ``name`` does not run in this case ("" : it runs)."""
    from funcopt.registry import REGISTRY

    if name == NS_FLOOR:  # Muon's reference (like the bandwidth), whatever --peers says
        return "" if algo == "Muon" else "-"
    if args.peers and not any(s in name for s in args.peers):
        return "-"  # filtered out: no note
    if name in COMPILED_PEERS:
        if args.no_compile:
            return "not run (--no-compile)"
        wanted = size in args.compile_sizes if args.compile_sizes else size != "tiny"
        if not wanted:
            return "not run at this size (--compile-sizes; compiling over 2000 tensors takes many minutes)"
    if name == "funcopt script foreach" and REGISTRY[algo].native_rule is None and not args.all_peers:
        return "not run: funcopt script (impl='auto') already runs the fused kernel or the foreach formula here"
    if numel >= HEAVY_NUMEL and name in HEAVY_PEERS and not args.all_peers:
        return "skipped at this size to keep the run short (--all-peers runs it)"
    return ""


# --------------------------------------------------------------------------- timing
@contextlib.contextmanager
def no_gc() -> Any:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def interleaved(steps: List[Step], warmup: int, repeats: int) -> List[List[float]]:
    """Per-peer per-step seconds; each repeat runs every peer once, start rotating."""
    n = len(steps)
    times: List[List[float]] = [[] for _ in steps]
    clock = time.perf_counter
    with no_gc():
        for r in range(warmup + repeats):
            for k in range(n):
                j = (r + k) % n
                t0 = clock()
                steps[j]()
                dt = clock() - t0
                if r >= warmup:
                    times[j].append(dt)
    return times


def measure_bandwidth(numel: int = 64 * 2**20, repeats: int = 10) -> Dict[str, float]:
    """Best and median GB/s of three streaming ops over ``numel`` fp32 (256 MB per tensor).

    ``a.add_(b)`` (read a, b; write a: 12 B/elem) has an optimizer step's in-place
    pattern, with no write-allocate traffic; it is the reference ("ref").
    ``torch.add(a, b, out=c)`` is counted as 12 B/elem too (STREAM's convention;
    the hardware also reads c before writing it), ``c.copy_(a)`` as 8 B/elem.
    """
    a, b, c = torch.rand(numel), torch.rand(numel), torch.empty(numel)
    out: Dict[str, float] = {}
    for name, fn, nbytes in (("inplace", lambda: a.add_(b, alpha=1e-30), 12),
                             ("add", lambda: torch.add(a, b, out=c), 12), ("copy", lambda: c.copy_(a), 8)):
        fn()
        ts = []
        with no_gc():
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        out[name + "_best"] = nbytes * numel / min(ts) / 1e9
        out[name + "_median"] = nbytes * numel / statistics.median(ts) / 1e9
    del a, b, c
    return out


# --------------------------------------------------------------------------- cases
def run_case(algo: str, size: str, args: argparse.Namespace, bw: float) -> Dict[str, Any]:
    """One (algorithm, size) case at the current intra-op thread count: build every peer,
    time them interleaved, print the table (``bw``: GB/s for %BW and the limit)."""
    from funcopt.registry import REGISTRY

    spec = REGISTRY[algo]
    shapes = [spec.param_shape(s) for s in case_shapes(size)]  # Muon: matrices (a bias (n,) as (n, 1))
    numel = sum(math.prod(s) for s in shapes)
    base = make_tensors(shapes, 0, 0.02)
    grads = make_tensors(shapes, 1, 1.0)
    gsum = float(sum(g.double().sum() for g in grads))
    names, steps, notes = [], [], []
    impl = ""
    chosen = [(n, b) for n, b in peers_for(algo) if skip_reason(n, algo, size, numel, args) != "-"]
    if any(n in COMPILED_PEERS and not skip_reason(n, algo, size, numel, args) for n, _ in chosen):
        torch._dynamo.reset()  # a fresh cache per case: no recompile limit reached across cases
    for name, build in chosen:
        why = skip_reason(name, algo, size, numel, args)
        if why:
            notes.append(f"{name}: {why}")
            continue
        params = [p.clone() for p in base]
        try:
            step, why = build(params, grads)
        except Exception as e:  # a compiler failure is a finding, not the end of the run
            if name not in COMPILED_PEERS:
                raise
            step, why = None, f"torch.compile failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        if why:
            notes.append(f"{name}: {why}")
        if step is None:
            continue
        if name == "funcopt script":
            impl = why.rsplit(" ", 1)[-1]
        names.append(name)
        steps.append(step)
    del base
    repeats = args.repeats or (8 if numel >= HEAVY_NUMEL else 15)
    c0, t0 = time.process_time(), time.perf_counter()
    times = interleaved(steps, args.warmup, repeats)
    wall = time.perf_counter() - t0
    cpu_per_wall = (time.process_time() - c0) / wall
    if abs(float(sum(g.double().sum() for g in grads)) - gsum) > 1e-6 * max(1.0, abs(gsum)):
        notes.append("WARNING: a peer modified the shared gradients; figures are suspect")
    med = {n: statistics.median(t) for n, t in zip(names, times)}
    spread = {n: (min(t), max(t)) for n, t in zip(names, times)}
    tr = traffic(algo, algo_info(algo)["kw"], shapes)
    res = dict(algo=algo, size=size, numel=numel, tensors=len(shapes), repeats=repeats, warmup=args.warmup,
               threads=torch.get_num_threads(), bytes_per_param=tr["bytes"], slots=tr["slots"], impl=impl,
               median_s=med, min_max_s=spread, notes=notes, times_s={n: t for n, t in zip(names, times)},
               wall_s=wall, cpu_per_wall=cpu_per_wall, loadavg=os.getloadavg())
    if NS_FLOOR in med:
        res["ns_gflop"] = ns_flops(shapes, ns_steps_of(algo)) / 1e9
        res["ns_flop_formula"] = NS_FLOP_FORMULA
        res["peak_matmul_gflops"] = peak_matmul()
    print_case(res, bw)
    del steps
    gc.collect()
    return res


def print_case(res: Dict[str, Any], bw: float) -> None:
    med: Dict[str, float] = res["median_s"]
    fused, foreach = med.get("torch.optim fused"), med.get("torch.optim foreach")
    bpp = res["bytes_per_param"]
    limit = bpp * res["numel"] / (bw * 1e9) if bw else 0.0
    print(f"\n{res['algo']}, {res['size']} ({res['numel']:,} params in {res['tensors']} tensors), "
          f"{res.get('threads', '?')} intra-op thread(s), median of {res['repeats']} interleaved steps "
          f"(after {res['warmup']} warm-up), load avg {res['loadavg'][0]:.2f}, this process got "
          f"{res['cpu_per_wall']:.2f} CPUs")
    print(f"  {'peer':<26}{'ms/step':>10}{'min..max ms':>17}{'/t.fused':>10}{'/t.foreach':>11}"
          f"{'GB/s':>8}{'%BW':>6}{'x limit':>9}   ({bpp:.2f} B/elem: p, g + {', '.join(res.get('slots', [])) or '-'}; "
          f"limit {limit * 1e3:.2f} ms)")
    for name, t in med.items():
        lo, hi = res["min_max_s"][name]
        r1 = f"{t / fused:.2f}x" if fused else "-"
        r2 = f"{t / foreach:.2f}x" if foreach else "-"
        gbs = bpp * res["numel"] / t / 1e9
        xl = f"{t / limit:.2f}x" if limit else "-"
        print(f"  {name:<26}{t * 1e3:>10.2f}{f'{lo * 1e3:.1f}..{hi * 1e3:.1f}':>17}{r1:>10}{r2:>11}"
              f"{gbs:>8.1f}{100 * gbs / bw if bw else 0:>5.0f}%{xl:>9}")
    if res.get("ns_gflop"):
        floor, pk = med[NS_FLOOR], res["peak_matmul_gflops"]
        print(f"  Newton-Schulz: {res['ns_gflop']:.4g} GFLOP per step ({res['ns_flop_formula']}); its matmuls "
              f"alone ({NS_FLOOR}) {floor * 1e3:.2f} ms = {res['ns_gflop'] / floor:.1f} GFLOP/s; this machine's "
              f"1024^3 torch.mm: {pk['bf16']:.1f} GFLOP/s bfloat16, {pk['fp32']:.1f} float32 (FLOP limit at that "
              f"rate {res['ns_gflop'] / pk['bf16'] * 1e3:.2f} ms)")
        for name, t in med.items():
            if name != NS_FLOOR:
                print(f"    {name:<26} {res['ns_gflop'] / t:8.1f} GFLOP/s, {t / floor:.2f}x the matmul floor, "
                      f"{t * pk['bf16'] / res['ns_gflop']:.2f}x the 1024^3 bf16 rate")
    for n in res["notes"]:
        print(f"  note: {n}")

"""Issue 21's figures of ``funcopt bench step``: the one-pass memory limit of every
algorithm, the per-(algorithm, size, threads) summary table, its target verdicts
and its Markdown (see :mod:`funcopt.bench.step`).

**The limit.** An elementwise optimizer rule that reads and writes every element
once moves, per fp32 parameter element: the parameter and the gradient read
(8 B), the parameter written (4 B), and each state tensor the hyperparameters
turn on read and written (8 B per state element).  Per-tensor scalars (step
counters, ASGD's ``eta``/``mu``, NAdam's ``mu_product``) count as one state
element per tensor.  The state shapes are the optimizer class's own
(``slot_shape``), so Adafactor's factored row/column state is counted as what
it is; its rule is not one pass (the row/column means read the gradient before
the update does), so its limit is a lower bound.  Muon's step is matmul-bound
(Newton-Schulz iterations per matrix): the memory limit is far below its real
floor and is printed for completeness only.  The limit in time is
``bytes x numel / bandwidth``, the bandwidth being the best ``a.add_(b)``
(12 B/elem, an optimizer's in-place pattern) measured in the same run at the
same intra-op thread count.
"""
from __future__ import annotations

import inspect
import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._report import ratio_row

# torch.optim has an ATen fused CPU kernel for these (issue 21's <= 1.0x target)
WHOLE_PARAM = ("Adafactor", "Muon")  # not elementwise: no <= 1.3x-the-limit target
TORCH_EAGER = ("torch.optim fused", "torch.optim foreach", "torch.optim for-loop")
OURS = "funcopt script"  # the default scripted optimizer (impl="auto")
LIMIT_TARGET, EAGER_TARGET_FUSED, EAGER_TARGET, COMPILED_TARGET = 1.3, 1.0, 0.5, 1.0
NOTES = {
    "Adafactor": "approximate: factored row/column state; torch's rule reads the gradient twice",
    "Muon": "matmul-bound: its limit is the Newton-Schulz matmuls alone (NS_FLOOR: the same shapes, "
            "bfloat16, interleaved), not the memory limit",
    "ASGD": "ax per element + per-tensor scalars eta, mu, step",
    "NAdam": "mu_product and step: per-tensor scalars",
}


# --------------------------------------------------------------------------- Muon's FLOP limit
NS_FLOOR = "matmul floor (NS shapes)"  # the peer timing Muon's Newton-Schulz matmuls alone
NS_FLOP_FORMULA = ("ns_steps x (4 m^2 n + 2 m^3) per A x B matrix, m = min(A, B), n = max(A, B): "
                   "X @ X^T (2 m^2 n), G @ G (2 m^3), (b G + c G @ G) @ X (2 m^2 n)")


def ns_dims(shape: Sequence[int]) -> Tuple[int, int]:
    """``(m, n)``, ``m <= n``: the shape of Muon's Newton-Schulz iterate ``X`` for a matrix of
    ``shape`` (torch transposes a tall matrix so the Gram matrix ``X @ X^T`` is the small one)."""
    a, b = int(shape[0]), int(shape[1])
    return min(a, b), max(a, b)


def ns_flops(shapes: Sequence[Sequence[int]], ns_steps: int = 5) -> float:
    """Floating-point operations of one Muon step's Newton-Schulz iterations over matrices of
    ``shapes`` (:data:`NS_FLOP_FORMULA`; a multiply-add counts 2).  Per iteration, with ``X``
    ``m x n`` (:func:`ns_dims`): the Gram matrix ``G = X @ X^T`` costs ``2 m^2 n``, ``G @ G``
    ``2 m^3``, and ``(b G + c G @ G) @ X`` ``2 m^2 n``; the elementwise scalings of the two
    ``addmm`` (``m^2 + m n``), the normalisation and the momentum are left out (lower order)."""
    total = 0.0
    for s in shapes:
        m, n = ns_dims(s)
        total += ns_steps * (4.0 * m * m * n + 2.0 * m ** 3)
    return total


def _on(cls: type, cond: Optional[str], kw: Dict[str, Any]) -> bool:
    """Whether a state slot whose flag is ``cond`` exists with hyperparameters ``kw``
    (the class's own default where ``kw`` does not set it)."""
    if cond is None:
        return True
    if cond in kw:
        return bool(kw[cond])
    p = inspect.signature(cls.__init__).parameters.get(cond)
    return bool(p is not None and p.default is not inspect.Parameter.empty and p.default)


def state_elements(algo: str, kw: Dict[str, Any], shapes: Sequence[Tuple[int, ...]]) -> Tuple[int, List[str]]:
    """Elements of optimizer state over parameters of ``shapes`` and the names of the slots on."""
    import torch

    from funcopt.registry import REGISTRY

    cls = REGISTRY[algo].cls
    names = [name for name, cond in cls.slots if _on(cls, cond, kw)]
    total = 0
    for s in shapes:
        p = torch.empty(s, device="meta")
        for name in names:
            shape = cls.slot_shape(name, p)
            if shape is not None:
                total += math.prod(shape)
    return total, names


def traffic(algo: str, kw: Dict[str, Any], shapes: Sequence[Tuple[int, ...]]) -> Dict[str, Any]:
    """One pass's bytes per fp32 parameter element over ``shapes`` (``bytes``), the slots on,
    and a note (approximations, per-tensor scalars)."""
    numel = sum(math.prod(s) for s in shapes)
    state, names = state_elements(algo, kw, shapes)
    per_elem = (12 * numel + 8 * state) / max(numel, 1)
    return dict(bytes=per_elem, slots=names, note=NOTES.get(algo, ""))


def per_element_bytes(algo: str, kw: Dict[str, Any]) -> int:
    """The familiar whole number (28 for Adam): 12 B + 8 B per state slot shaped like a
    (large, 2-D) parameter; per-tensor scalars and factored state left out."""
    state, _ = state_elements(algo, kw, [(1 << 10, 1 << 10)])
    return 12 + 8 * (state // (1 << 20))


# --------------------------------------------------------------------------- the summary
def best_bandwidth(results: Dict[str, Any], threads: int) -> float:
    """The best ``a.add_(b)`` GB/s of the run at ``threads`` intra-op threads."""
    bws = [b["inplace_best"] for b in results.get("bandwidth", []) if b.get("threads", threads) == threads]
    return max(bws, default=0.0)


def _fastest(c: Dict[str, Any], names: Sequence[str]) -> Optional[str]:
    have = [n for n in names if n in c.get("median_s", {})]
    return min(have, key=lambda n: c["median_s"][n]) if have else None


def _elementwise_min(a: Sequence[float], b: Sequence[float]) -> List[float]:
    return [min(x, y) for x, y in zip(a, b)]


def case_figures(c: Dict[str, Any], bw: float) -> Dict[str, Any]:
    """The issue-21 figures of one case: per-repeat ratios and the medians."""
    from funcopt.registry import REGISTRY

    t, med = c.get("times_s", {}), c.get("median_s", {})
    size, threads = c["size"], c.get("threads", 0)
    fused = "cpu" in REGISTRY[c["algo"]].fused_devices
    out: Dict[str, Any] = dict(algo=c["algo"], size=size, threads=threads, bytes=c["bytes_per_param"],
                               numel=c["numel"], fused=fused, impl=c.get("impl", ""))
    out["limit_s"] = c["bytes_per_param"] * c["numel"] / (bw * 1e9) if bw else None
    ours = t.get(OURS)
    out["ours_s"] = med.get(OURS)
    floor = t.get(NS_FLOOR)
    if floor:  # Muon: the limit is its matmuls alone, timed in the same repeats
        out["limit_s"] = med[NS_FLOOR]
        out["limit_kind"] = "flop"
        if ours:
            out["x_limit"] = [a / b for a, b in zip(ours, floor)]
    elif ours and out["limit_s"]:
        out["x_limit"] = [x / out["limit_s"] for x in ours]
    best = _fastest(c, TORCH_EAGER)
    out["torch_best"] = best
    if ours and best:
        out["torch_best_s"] = med[best]
        out["x_torch"] = [a / b for a, b in zip(ours, t[best])]
    comp, rivals = t.get("funcopt compiled"), [t[n] for n in ("torch.optim compiled", "funcopt eager") if n in t]
    if comp and rivals:
        floor = rivals[0] if len(rivals) == 1 else _elementwise_min(rivals[0], rivals[1])
        out["compiled_s"], out["compiled_rival_s"] = med["funcopt compiled"], statistics.median(floor)
        out["x_compiled"] = [a / b for a, b in zip(comp, floor)]
    return out


def targets(f: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """Issue 21's targets for one case (None: no target for this figure here)."""
    big = f["size"] in ("16M", "64M")
    return dict(
        x_limit=LIMIT_TARGET if big and f["algo"] not in WHOLE_PARAM else None,
        x_torch=EAGER_TARGET if f["size"] == "tiny" or not f["fused"] else EAGER_TARGET_FUSED,
        x_compiled=COMPILED_TARGET,
    )


def verdict_rows(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Summary rows (``_report.ratio_row``) of issue 21's targets, every case."""
    rows: List[Dict[str, Any]] = []
    for c in results.get("cases", []):
        f = case_figures(c, best_bandwidth(results, c.get("threads", 0)))
        tg = targets(f)
        name = f"{f['algo']} {f['size']}, {f['threads']} thr"
        if "x_limit" in f and f.get("limit_kind") == "flop":
            rows.append(ratio_row("step", f"{name}: {OURS} / its Newton-Schulz matmuls alone ({NS_FLOOR}, "
                                          f"{c.get('ns_gflop', 0):.3g} GFLOP)", f["x_limit"], None, "lower",
                                  NOTES.get(f["algo"], "")))
        elif "x_limit" in f:
            rows.append(ratio_row("step", f"{name}: {OURS} / one-pass limit ({f['bytes']:.1f} B/elem)",
                                  f["x_limit"], tg["x_limit"], "lower", NOTES.get(f["algo"], "")))
        if "x_torch" in f:
            rows.append(ratio_row("step", f"{name}: {OURS} / {f['torch_best']} (fastest torch eager)",
                                  f["x_torch"], tg["x_torch"], "lower"))
        if "x_compiled" in f:
            rows.append(ratio_row("step", f"{name}: funcopt compiled / min(torch.optim compiled, funcopt eager)",
                                  f["x_compiled"], tg["x_compiled"], "lower"))
    return rows


def _cell(ratios: Optional[Sequence[float]], target: Optional[float]) -> str:
    if not ratios:
        return "-"
    r = ratio_row("", "", ratios, target, "lower")
    mark = {"met": " ok", "missed": " MISS", "not met (spread crosses target)": " ~"}.get(r["verdict"], "")
    return f"{r['median']:.2f}x{mark}"


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def table(results: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    """The issue-21 summary table: a header and one row per (algorithm, size, threads)."""
    head = ["algorithm", "size", "thr", "B/elem", "limit ms", f"{OURS} ms", "impl", "x limit",
            "fastest torch eager", "ms", "x torch", "funcopt compiled ms", "min(t.compiled, f.eager) ms",
            "x compiled"]
    rows = []
    for c in results.get("cases", []):
        f = case_figures(c, best_bandwidth(results, c.get("threads", 0)))
        tg = targets(f)
        rows.append([f["algo"], f["size"], str(f["threads"]), f"{f['bytes']:.1f}", _ms(f["limit_s"]),
                     _ms(f["ours_s"]), f["impl"] or "-", _cell(f.get("x_limit"), tg["x_limit"]),
                     (f["torch_best"] or "-").replace("torch.optim ", ""), _ms(f.get("torch_best_s")),
                     _cell(f.get("x_torch"), tg["x_torch"]), _ms(f.get("compiled_s")),
                     _ms(f.get("compiled_rival_s")), _cell(f.get("x_compiled"), tg["x_compiled"])])
    return head, rows


LEGEND = (f"x limit: {OURS} (impl='auto': native rule, ATen fused kernel or foreach) / (B/elem x numel / the run's "
          f"best a.add_(b) at that thread count), target <= {LIMIT_TARGET}x for elementwise rules at 16M/64M; "
          f"x torch: / the fastest of torch.optim for-loop, foreach, fused, target <= {EAGER_TARGET_FUSED}x where "
          f"torch has a fused kernel (Adam, AdamW, SGD, Adagrad), <= {EAGER_TARGET}x elsewhere and at tiny; "
          f"x compiled: torch.compile(funcopt eager opt.step) / min(torch.compile(torch.optim opt.step), funcopt "
          f"eager), target <= {COMPILED_TARGET}x. Medians of per-repeat ratios; ok: the whole spread meets the "
          "target, MISS: none of it does, ~: the spread crosses it. Muon: limit ms and x limit are against its "
          f"Newton-Schulz matmuls alone ('{NS_FLOOR}': the same shapes in bfloat16, in the same repeats).")


def tally(results: Dict[str, Any]) -> str:
    """One line: how many cases meet each of issue 21's targets."""
    parts = []
    for key, what in (("x_limit", f"<= {LIMIT_TARGET}x the limit (elementwise, 16M/64M)"),
                      ("x_torch", "vs torch's fastest eager"), ("x_compiled", "compiled")):
        counts = {"met": 0, "crossing": 0, "missed": 0}
        for c in results.get("cases", []):
            f = case_figures(c, best_bandwidth(results, c.get("threads", 0)))
            target = targets(f)[key]
            if f.get(key) and target is not None:
                v = ratio_row("", "", f[key], target, "lower")["verdict"]
                counts["met" if v == "met" else "missed" if v == "missed" else "crossing"] += 1
        if sum(counts.values()):
            parts.append(f"{what}: {counts['met']} met, {counts['crossing']} spread crossing, "
                         f"{counts['missed']} missed")
    return "issue 21 targets, cases: " + "; ".join(parts) if parts else ""


def print_table(results: Dict[str, Any]) -> None:
    head, rows = table(results)
    if not rows:
        return
    print("\nIssue 21 summary (median ms/step; ratios are medians over the interleaved repeats)")
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for k, r in enumerate([head] + rows):
        print("  " + "  ".join(x.ljust(w) if i in (0, 1, 2, 6, 8) else x.rjust(w)
                               for i, (x, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print("  " + LEGEND)
    if tally(results):
        print("  " + tally(results))
    notes = sorted({c["algo"] for c in results.get("cases", []) if c["algo"] in NOTES})
    for a in notes:
        print(f"  {a}: {NOTES[a]}")


def markdown(results: Dict[str, Any]) -> str:
    head, rows = table(results)
    if not rows:
        return ""
    text = (0, 1, 2, 6, 8)  # left-aligned columns: names; the rest are numbers
    lines = ["**Issue 21 summary** (median ms/step)", "", "| " + " | ".join(head) + " |",
             "|" + "".join("---|" if i in text else "---:|" for i in range(len(head)))]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", LEGEND, "", tally(results) + "."]
    lines += [f"{a}: {NOTES[a]}." for a in sorted({c['algo'] for c in results.get('cases', []) if c['algo'] in NOTES})]
    return "\n".join(lines) + "\n"

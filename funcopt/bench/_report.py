"""Ratios with their spread, targets judged on the whole spread, the summary table."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence


def ratio_row(layer: str, figure: str, ratios: Sequence[float], target: Optional[float] = None,
              better: str = "lower", note: str = "") -> Dict[str, Any]:
    """One summary row: the median ratio, its min-max over repeats, and the verdict.

    ``better="lower"``: the target is met when the *largest* ratio is <= target;
    ``"higher"``: when the *smallest* is >= target.  No target: no verdict."""
    rs = [float(r) for r in ratios if r == r]
    if not rs:
        return dict(layer=layer, figure=figure, median=None, min=None, max=None, n=0, target=target,
                    better=better, verdict="no data", note=note)
    lo, hi, med = min(rs), max(rs), statistics.median(rs)
    verdict = ""
    if target is not None:
        if better == "lower":
            verdict = "met" if hi <= target else ("missed" if lo > target else "not met (spread crosses target)")
        else:
            verdict = "met" if lo >= target else ("missed" if hi < target else "not met (spread crosses target)")
    return dict(layer=layer, figure=figure, median=med, min=lo, max=hi, n=len(rs), target=target, better=better,
                verdict=verdict, note=note)


def fmt_spread(row: Dict[str, Any]) -> str:
    if row["median"] is None:
        return "-"
    return f"{row['median']:.2f}x ({row['min']:.2f}-{row['max']:.2f})"


def print_summary(rows: List[Dict[str, Any]], title: str = "summary") -> None:
    """The summary table: layer, figure, median ratio (min-max over repeats), target, verdict."""
    print()
    print(title)
    if not rows:
        print("  (no ratios)")
        return
    head = ("layer", "figure", "ratio (min-max)", "n", "target", "verdict")
    cells = [head]
    for r in rows:
        tgt = "-" if r["target"] is None else (("<= " if r["better"] == "lower" else ">= ") + f"{r['target']:g}x")
        cells.append((r["layer"], r["figure"], fmt_spread(r), str(r["n"]), tgt, r["verdict"] or "-"))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for k, c in enumerate(cells):
        print("  " + "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))
    notes = [f"  {r['layer']} / {r['figure']}: {r['note']}" for r in rows if r.get("note")]
    if notes:
        print("notes:")
        print("\n".join(notes))

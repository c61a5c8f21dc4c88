"""Ratios with their spread, targets judged on the whole spread, the summary table."""
from __future__ import annotations

import os
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


_KINETO_LINE = None


def _kineto_line(line: str) -> bool:
    """A log line torch's profiler writes straight to fd 2: libkineto's (``USDT:2026-... profiler_start``)
    or c10's profiler notices (``[W1126 ... utils.cpp:165] Warning: Profiling a distributed call ...``)."""
    import re

    global _KINETO_LINE
    if _KINETO_LINE is None:
        _KINETO_LINE = re.compile(
            r"^(USDT|STAGE|INFO|WARNING|ERROR|[IWE]\d{4}):?\s?\d{4}-\d\d-\d\d .*\.cpp:\d+\]"  # libkineto's log
            r"|^(\[rank\d+\]:)?\[W\d{4} [\d:.]+ \w+\.cpp:\d+\] Warning: Profil")  # c10's profiler notices
    return bool(_KINETO_LINE.match(line))


class quiet_profiler:
    """Around a torch.profiler session: torch's profiler notices stay out of the output.

    Drops (a) the profiler's Python ``UserWarning`` about clearing events per
    cycle and (b) libkineto's log lines, which C++ writes to file descriptor 2
    (``USDT:... profiler_start``): fd 2 goes to a temporary file while the
    block runs, and every other line in it is written back to stderr after."""

    def __enter__(self) -> "quiet_profiler":
        import tempfile
        import warnings

        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.filterwarnings("ignore", message=r".*Profiler clears events at the end of each cycle",
                                category=UserWarning)
        sys_stderr_flush()
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._tmp.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys_stderr_flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        kept = [ln for ln in self._tmp.read().decode(errors="replace").splitlines(keepends=True)
                if not _kineto_line(ln)]
        self._tmp.close()
        self._warn.__exit__(*exc)
        if kept:
            import sys

            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def sys_stderr_flush() -> None:
    import sys

    sys.stderr.flush()

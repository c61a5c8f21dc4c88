"""The default step: a git revision of funcopt against the working tree, in one process.

Answers "did this change slow the default path down?".  The whole ``funcopt``
package as it was at ``--base`` is extracted to a temporary directory and
imported under another name, next to the working tree's ``funcopt``.  For each
size, both versions get their own copy of the same parameters and the same
gradients (contiguous fp32), and the rounds alternate (the first version flips
every round), so background load hits both alike.  Each round is the median of
``--inner`` steps; the table gives the median round of each version, and the
ratio working tree / base as the median and min-max over rounds (each round's
ratio pairs the two versions' adjacent measurements).

Run::

    python benchmarks/step_revision.py --base adbe7ac              # Adam, eager and scripted
    python benchmarks/step_revision.py --base HEAD~3 --algos SGD,Adam --modes scripted --rounds 41
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import funcopt  # noqa: E402

SIZES: Dict[str, Tuple[int, int]] = {  # name: (tensors, elements each)
    "2000x1K": (2000, 1024),
    "200x64K": (200, 1 << 16),
    "4x4M": (4, 1 << 22),
}


def _extract(base: str, tmp: str) -> Any:
    """Import funcopt as of ``base`` as the package ``funcopt_base``."""
    archive = os.path.join(tmp, "base.tar")
    subprocess.run(["git", "archive", "--format=tar", "-o", archive, base, "funcopt"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    os.rename(os.path.join(tmp, "funcopt"), os.path.join(tmp, "funcopt_base"))
    sys.path.insert(0, tmp)
    return importlib.import_module("funcopt_base")


def _build(pkg: Any, algo: str, mode: str, params: List[torch.Tensor]) -> Any:
    opt = getattr(pkg, algo)(params, lr=1e-3)
    if mode == "scripted":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pkg.script(opt)
    return opt


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare with (default: HEAD)")
    ap.add_argument("--algos", default="Adam", help="comma-separated registry names (default: Adam)")
    ap.add_argument("--modes", default="eager,scripted")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--inner", type=int, default=5, help="steps per round (their median is the round's time)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "funcopt"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_pkg = _extract(args.base, tmp)
        print(f"default step (impl='auto'), {args.base} vs working tree at {commit}{' + changes' if dirty else ''}; "
              f"{args.rounds} rounds x {args.inner} steps, alternating; {args.threads} thread(s); "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"| algorithm | mode | size | {args.base} ms | tree ms | tree / base: median (min-max) |")
        print("|---|---|---|---|---|---|")
        for algo in args.algos.split(","):
            for mode in args.modes.split(","):
                for size in args.sizes.split(","):
                    n, numel = SIZES[size]
                    gen = torch.Generator().manual_seed(0)
                    init = [torch.randn(numel, generator=gen) for _ in range(n)]
                    grads = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(n)]
                    opts = {}
                    for key, pkg in (("base", base_pkg), ("tree", funcopt)):
                        params = [t.clone().requires_grad_() for t in init]
                        opts[key] = _build(pkg, algo, mode, params)
                        for _ in range(3):
                            opts[key].step(grads)
                    times: Dict[str, List[float]] = {"base": [], "tree": []}
                    order = ["base", "tree"]
                    for r in range(args.rounds):
                        for key in (order if r % 2 == 0 else order[::-1]):
                            inner = []
                            for _ in range(args.inner):
                                t0 = time.perf_counter()
                                opts[key].step(grads)
                                inner.append(time.perf_counter() - t0)
                            times[key].append(statistics.median(inner))
                    ratios = [t / b for t, b in zip(times["tree"], times["base"])]
                    mb, mt = statistics.median(times["base"]), statistics.median(times["tree"])
                    print(f"| {algo} | {mode} | {size} | {mb * 1e3:.3f} | {mt * 1e3:.3f} | "
                          f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)
                    del opts
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

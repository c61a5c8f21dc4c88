"""``Slots.select`` (gradient validation + split by bucket): a git revision vs the working tree.

``select`` is funcopt's own per-tensor cost in a scripted step (docs/benchmarks.md,
"Where a scripted fused step goes on 2000 small tensors").  This loads
``funcopt/_slots.py`` as it was at ``--base`` next to the working tree's, scripts
both over the same parameters and times ``select(grads)`` alternately (the order
flips every round), then prints medians, minima and the ratio.

Run::

    python benchmarks/slots_select.py --base HEAD~1          # 2000 x 1024 fp32, 60 rounds
    python benchmarks/slots_select.py --base v0.1 --tensors 63 --rounds 200
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import List

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from funcopt.script import script_object  # noqa: E402


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # TorchScript reads the class source through its module
    spec.loader.exec_module(mod)
    return mod


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare with (default: HEAD)")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    src = subprocess.run(["git", "show", f"{args.base}:funcopt/_slots.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        base_path = os.path.join(tmp, "base_slots.py")
        Path(base_path).write_text(src)
        mods = {args.base: _load(base_path, "base_slots"), "working tree": _load(str(ROOT / "funcopt" / "_slots.py"),
                                                                                "tree_slots")}
        n = args.tensors
        params = [torch.zeros(args.numel) for _ in range(n)]
        grads: List[torch.Tensor] = [torch.ones(args.numel) for _ in range(n)]
        built = {k: script_object(m.Slots(list(params), [0] * n, [list(range(n))], [True], [{"lr": 1e-3}], 3))
                 for k, m in mods.items()}
    names = list(built)
    for s in built.values():
        for _ in range(5):
            s.select(grads)
    times = {k: [] for k in names}
    for r in range(args.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            built[k].select(grads)
            times[k].append(time.perf_counter() - t0)
    print(f"Slots.select over {n} x {args.numel} fp32 gradients, {args.rounds} rounds alternating, 1 thread; "
          f"load average {os.getloadavg()[0]:.1f}")
    for k in names:
        print(f"  {k:>14}: median {statistics.median(times[k]) * 1e3:.3f} ms, min {min(times[k]) * 1e3:.3f} ms, "
              f"{statistics.median(times[k]) / n * 1e6:.2f} us per gradient")
    print(f"  working tree / {args.base}: {statistics.median(times[names[1]]) / statistics.median(times[names[0]]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

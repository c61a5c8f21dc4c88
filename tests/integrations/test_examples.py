"""The ``examples/`` scripts of docs/integrations.md run to the end: all of them in one
child interpreter (``runpy``, as ``__main__``, one import of torch and the frameworks),
each printing its last line; a script whose framework is missing is left out, and the
test names it (it fails only for a script that ran)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "amp_grad_scaler.py": (None, "step 7"),
    "fsdp2_dcp.py": (None, "restored parameters equal: True"),
    "accelerate_loop.py": ("accelerate", "loss"),
    "lightning_trainer.py": ("pytorch_lightning", "steps"),
    "transformers_trainer.py": ("transformers", "TrainOutput"),
}
RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback, warnings
warnings.filterwarnings("ignore")
out = {}
for path in sys.argv[2:]:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        out[path] = [True, buf.getvalue()]
    except BaseException:
        out[path] = [False, buf.getvalue() + traceback.format_exc()]
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.timeout(600)
def test_examples_run(tmp_path):
    runnable = [s for s, (m, _) in EXAMPLES.items() if m is None or importlib.util.find_spec(m) is not None]
    missing = sorted({m for s, (m, _) in EXAMPLES.items() if s not in runnable})
    paths = [str(ROOT / "examples" / s) for s in runnable]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "out.json"), *paths], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    results = json.loads((tmp_path / "out.json").read_text())
    for script, path in zip(runnable, paths):
        ok, output = results[path]
        assert ok, f"{script} raised:\n{output[-4000:]}"
        assert EXAMPLES[script][1] in output, f"{script}: {EXAMPLES[script][1]!r} not in its output:\n{output[-2000:]}"
    if missing:
        pytest.skip(f"ran {len(runnable)} examples; {', '.join(missing)} not installed "
                    "(pip install 'funcopt[integrations]')")

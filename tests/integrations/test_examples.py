"""Each ``examples/`` script of docs/integrations.md runs to the end (exit status 0 and its
last line printed); a script whose framework is missing is skipped, naming it."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "lightning_trainer.py": ("pytorch_lightning", "steps"),
    "transformers_trainer.py": ("transformers", "TrainOutput"),
    "accelerate_loop.py": ("accelerate", "loss"),
    "amp_grad_scaler.py": (None, "step 7"),
    "fsdp2_dcp.py": (None, "restored parameters equal: True"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", list(EXAMPLES))
def test_example_runs(script, tmp_path):
    module, expected = EXAMPLES[script]
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed (pip install 'funcopt[integrations]')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{script}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert expected in proc.stdout, f"{script}: {expected!r} not in its output:\n{proc.stdout[-2000:]}"

"""PyTorch Lightning ``Trainer`` (CPU) drives funcopt optimizers as it drives torch.optim.

For every registry algorithm, funcopt eager and scripted, each run is compared with
the same run using the torch.optim class of the same name (float32 rtol 1e-5):

* automatic optimization with an LR-scheduler dict (``interval="step"``),
  ``accumulate_grad_batches=2`` and ``gradient_clip_val`` (norm);
* ``gradient_clip_algorithm="value"``;
* manual optimization (``self.optimizers()``, ``manual_backward``, ``step``);
* ``ModelCheckpoint`` + ``fit(ckpt_path=...)``: the resumed run equals the
  uninterrupted one exactly;
* ``strategy="ddp"`` on 2 CPU processes (``_lightning_ddp.py`` in a subprocess: Lightning
  re-launches its own script for its ranks).

Lightning calls ``optimizer.step(closure=...)`` in automatic optimization.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _common import algorithm_cases, assert_close, assert_equal, assert_trained, need, snapshot

need("pytorch_lightning")

import _lightning_common as L  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
CASES = algorithm_cases()
SCENARIOS = {
    "auto-sched-accum-clipnorm": dict(trainer=dict(accumulate_grad_batches=2, gradient_clip_val=0.5)),
    "clip-value": dict(trainer=dict(gradient_clip_val=0.05, gradient_clip_algorithm="value")),
    "manual": dict(manual=True),
}
_ORACLE: dict = {}


def _run(name, flavour, scenario, tmp_path):
    cfg = SCENARIOS[scenario]
    module = L.Module(name, flavour, manual=cfg.get("manual", False))
    before = snapshot(module.parameters())
    L.fit(module, tmp_path / f"{name}-{flavour}-{scenario}", max_epochs=2, **cfg.get("trainer", {}))
    return before, snapshot(module.parameters()), module.lrs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name,flavour", CASES)
def test_fit_matches_torch_optim(name, flavour, scenario, tmp_path):
    key = (name, scenario)
    if key not in _ORACLE:
        _ORACLE[key] = _run(name, "torch", scenario, tmp_path)
    before, want, want_lrs = _ORACLE[key]
    _, got, lrs = _run(name, flavour, scenario, tmp_path)
    assert_trained(before, want, f"{name} {scenario} torch.optim")
    assert_close(got, want, f"{name} {flavour} {scenario} vs torch.optim", algo=name)
    assert lrs == want_lrs, "the scheduler drove another lr sequence"


@pytest.mark.parametrize("name,flavour", CASES)
def test_checkpoint_resume_continues_exactly(name, flavour, tmp_path):
    """Two epochs, ModelCheckpoint after each; a new Trainer resumes from the first
    epoch's checkpoint and trains the second: equal to the uninterrupted run."""
    straight = L.Module(name, flavour)
    ckpts = L.fit(straight, tmp_path / "straight", max_epochs=2, checkpoint=True)
    first = [c for c in ckpts if "epoch=0" in c.name]
    assert len(first) == 1, f"expected one checkpoint of epoch 0, got {ckpts}"
    resumed = L.Module(name, flavour)
    L.fit(resumed, tmp_path / "resumed", max_epochs=2, ckpt_path=str(first[0]))
    assert_equal(snapshot(resumed.parameters()), snapshot(straight.parameters()),
                 f"{name} {flavour}: resumed from epoch 0 vs uninterrupted")
    oracle = L.Module(name, "torch")
    L.fit(oracle, tmp_path / "oracle", max_epochs=2)
    assert_close(snapshot(resumed.parameters()), snapshot(oracle.parameters()), f"{name} {flavour} vs torch.optim",
                 algo=name)


def test_ddp_two_cpu_processes(tmp_path):
    """strategy="ddp", 2 CPU processes, every algorithm (funcopt eager and torch.optim; the
    scripted step is Lightning-tested above) in one launch; rank 0 writes the final
    parameters of each run."""
    out = tmp_path / "ddp.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "_lightning_ddp.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = torch.load(out)
    for name, flavour in [c.values for c in CASES if c.values[1] == "eager"]:
        want = results[(name, "torch")]
        assert_close(results[(name, flavour)], want, f"ddp {name} {flavour} vs torch.optim", algo=name)
        assert_trained(results[(name, "init")], want, f"ddp {name} torch.optim")

"""accelerate: ``prepare``, ``backward``, ``clip_grad_norm_``, ``accumulate`` and
``save_state`` / ``load_state`` with funcopt optimizers.

For every registry algorithm, funcopt eager and scripted, the run equals the same run
with the torch.optim class of the same name (float32 rtol 1e-5), and a run resumed
with ``load_state`` from a ``save_state`` taken mid-training equals the uninterrupted
one exactly.
"""
from __future__ import annotations

import pytest
import torch

from _common import (algorithm_cases, assert_close, assert_equal, assert_trained, make_optimizer, need, snapshot,
                     tiny_data, tiny_model)

need("accelerate")

from accelerate import Accelerator  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]
CASES = algorithm_cases()
MICRO_STEPS, SAVE_AT = 8, 4  # micro-batches; accumulation 2: 4 optimizer steps, saved after 2
_ORACLE: dict = {}


def run(name: str, flavour: str, save: str = None, load: str = None) -> list:
    """Micro-batches [0, MICRO_STEPS), or [SAVE_AT, MICRO_STEPS) after ``load_state(load)``;
    ``save_state(save)`` after micro-batch SAVE_AT - 1."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_model()
    opt = make_optimizer(name, flavour, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    model, opt, sched = acc.prepare(model, opt, sched)
    x, y = tiny_data().tensors
    start = 0
    if load is not None:
        acc.load_state(load)
        start = SAVE_AT
    for i in range(start, MICRO_STEPS):
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4])
            acc.backward(loss)
            if acc.sync_gradients:  # the optimizer's parameters: Muon leaves the biases out (and their
                # gradients uncleared by opt.zero_grad(), so clipping them would differ after a resume)
                acc.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        if save is not None and i == SAVE_AT - 1:
            acc.save_state(save)
    acc.free_memory()
    return snapshot(model.parameters())


@pytest.mark.parametrize("name,flavour", CASES)
def test_accelerate_matches_torch_optim_and_resumes_exactly(name, flavour, tmp_path):
    if name not in _ORACLE:
        _ORACLE[name] = run(name, "torch")
    want = _ORACLE[name]
    assert_trained(snapshot(tiny_model().parameters()), want, f"{name} torch.optim")
    got = run(name, flavour, save=str(tmp_path / "state"))
    assert_close(got, want, f"{name} {flavour} vs torch.optim", algo=name)
    resumed = run(name, flavour, load=str(tmp_path / "state"))
    assert_equal(resumed, got, f"{name} {flavour}: load_state after {SAVE_AT} micro-batches vs uninterrupted")

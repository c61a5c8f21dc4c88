"""``torch.autocast("cpu", dtype=torch.bfloat16)`` + ``torch.amp.GradScaler("cpu")``:
an overflow step is skipped exactly as torch.optim skips it.

Six steps; after the third backward one scaled gradient element is set to inf.  For
every registry algorithm, funcopt eager and scripted: the parameters are unchanged by
the overflow step, the scale backs off and grows as with torch.optim, and the final
parameters equal torch.optim's (float32 rtol 1e-5).  Needs no extra package.
"""
from __future__ import annotations

import pytest
import torch

from _common import algorithm_cases, assert_close, assert_equal, assert_trained, make_optimizer, snapshot, tiny_data
from _common import tiny_model

CASES = algorithm_cases()
STEPS, OVERFLOW = 6, 2
_ORACLE: dict = {}


def run(name: str, flavour: str):
    model = tiny_model()
    opt = make_optimizer(name, flavour, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    x, y = tiny_data().tensors
    history, scales = [snapshot(model.parameters())], []
    for step in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[4 * step:4 * step + 4])
        loss = torch.nn.functional.mse_loss(out.float(), y[4 * step:4 * step + 4])
        scaler.scale(loss).backward()
        if step == OVERFLOW:
            first = opt.param_groups[0]["params"][0]
            first.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        history.append(snapshot(model.parameters()))
        scales.append(scaler.get_scale())
    return history, scales


@pytest.mark.parametrize("name,flavour", CASES)
def test_grad_scaler_bf16_autocast_matches_torch_optim(name, flavour):
    if name not in _ORACLE:
        _ORACLE[name] = run(name, "torch")
    want_hist, want_scales = _ORACLE[name]
    got_hist, got_scales = run(name, flavour)
    assert want_scales[OVERFLOW] < want_scales[OVERFLOW - 1], "torch.optim: the overflow did not back off the scale"
    assert got_scales == want_scales, f"{name} {flavour}: scales {got_scales}, torch.optim {want_scales}"
    assert_equal(got_hist[OVERFLOW + 1], got_hist[OVERFLOW], f"{name} {flavour}: the overflow step changed params")
    assert_trained(want_hist[0], want_hist[-1], f"{name} torch.optim")
    for step in range(1, STEPS + 1):
        assert_close(got_hist[step], want_hist[step], f"{name} {flavour} after step {step} vs torch.optim",
                     algo=name)

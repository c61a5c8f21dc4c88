"""Muon's learning-rate adjustments: every ``adjust_lr_fn`` value the installed
``torch.optim.Muon`` accepts gives torch's numbers bitwise (eager and
scripted, tall, wide and square matrices), and every value it refuses is
refused by funcopt with torch's message.  torch 2.15 added
``"spectral_unclamped"``; torch 2.13 refuses it, so the set is read from the
installed torch rather than written down here."""
import pytest
import torch

import funcopt
from funcopt.optimizers.muon import ADJUST_LR_CODES

STEPS = 6
SHAPES = [(6, 3), (3, 6), (4, 4)]


def _torch_accepts(value):
    try:
        torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)], adjust_lr_fn=value)
    except ValueError:
        return False
    return True


def _run(make_opt, value, dtype, scripted=False):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]
    opt = make_opt(params, lr=0.02, weight_decay=0.1, adjust_lr_fn=value)
    if scripted:
        funcopt.script(opt)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in params]
        if isinstance(opt, funcopt.Muon):
            opt.step(grads)
        else:
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("value", list(ADJUST_LR_CODES), ids=repr)
def test_adjust_lr_fn_matches_torch(value, dtype, scripted):
    if not _torch_accepts(value):
        with pytest.raises(ValueError, match="Adjust learning rate function"):
            funcopt.Muon([torch.zeros(2, 2, requires_grad=True)], adjust_lr_fn=value)
        return
    expected = _run(torch.optim.Muon, value, dtype)
    got = _run(funcopt.Muon, value, dtype, scripted)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_every_value_torch_accepts_has_a_code():
    """A value the installed torch accepts but funcopt has no code for would be
    let through by torch's validation; funcopt must know every such value."""
    for value in (None, "original", "match_rms_adamw", "spectral_unclamped"):
        if _torch_accepts(value):
            assert value in ADJUST_LR_CODES


def test_unknown_value_is_refused_before_anything_changes():
    w = torch.ones(2, 2, requires_grad=True)
    opt = funcopt.Muon([w], lr=0.1)
    opt.param_groups[0]["adjust_lr_fn"] = "no_such_rule"  # set after construction, past torch's check
    # torch 2.13's constructor lets any string through (funcopt's code table refuses it);
    # 2.15's refuses it itself (its message, with funcopt's "(adjust_lr_fn=...)" appended)
    with pytest.raises(ValueError, match="not supported") as e:
        opt.step([torch.ones(2, 2)])
    assert "adjust_lr_fn='no_such_rule'" in str(e.value), str(e.value)
    assert torch.equal(w, torch.ones(2, 2))
    assert len(opt.state) == 0 or all(int(s["step"]) == 0 for s in opt.state.values() if "step" in s)

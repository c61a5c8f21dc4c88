"""funcopt.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ (the oracle):
the returned norm and the clipped gradients, eager and inside a scripted
train step, for several norm types (inf included), dtypes, None entries,
non-contiguous gradients, an empty list, and the non-finite error."""
import math
from typing import List, Optional

import pytest
import torch
from torch import Tensor

import funcopt

pytestmark = pytest.mark.usefixtures("single_thread")

NORMS = [2.0, 1.0, 3.0, 0.5, math.inf]
DTYPES = {"f32": [torch.float32] * 3, "f64": [torch.float64] * 3,
          "mixed": [torch.float32, torch.float64, torch.float16]}


def _torch_clip(grads: List[Optional[Tensor]], max_norm: float, norm_type: float, error_if_nonfinite: bool = False):
    """torch.nn.utils.clip_grad_norm_ over parameters whose .grad are copies of ``grads``."""
    params = []
    for g in grads:
        p = torch.zeros(1) if g is None else torch.zeros_like(g)
        p.grad = None if g is None else g.clone()
        params.append(p)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return total, [p.grad for p in params]


@torch.jit.script
def _scripted_train_step(grads: List[Optional[Tensor]], max_norm: float, norm_type: float) -> Tensor:
    # clipping inside a scripted function, as a scripted train step would call it
    return funcopt.clip_grad_norm_(grads, max_norm, norm_type)


def _grads(dtypes: List[torch.dtype], seed: int) -> List[Optional[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    gs: List[Optional[Tensor]] = [torch.randn(s, generator=gen).to(d)
                                  for s, d in zip([(4, 3), (5,), (2, 3, 2)], dtypes)]
    gs[0] = gs[0].t()  # non-contiguous
    gs.insert(1, None)
    return gs


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
@pytest.mark.parametrize("norm_type", NORMS)
def test_matches_torch(norm_type, max_norm, dtypes, mode):
    grads = _grads(DTYPES[dtypes], seed=int(max_norm * 10))
    want_total, want = _torch_clip(grads, max_norm, norm_type)
    mine = [None if g is None else g.clone() for g in grads]
    kept = [g for g in mine if g is not None]  # clipped in place: these very tensors
    if mode == "eager":
        total = funcopt.clip_grad_norm_(mine, max_norm, norm_type)
    else:
        total = _scripted_train_step(mine, max_norm, norm_type)
    # scripted with several dtypes: the per-dtype norms are stacked in another order
    exact = mode == "eager" or dtypes != "mixed"
    assert total.dtype == want_total.dtype
    if exact:
        assert torch.equal(total, want_total), (total, want_total)
    else:
        torch.testing.assert_close(total, want_total)
    assert mine[1] is None
    for a, b in zip(kept, [w for w in want if w is not None]):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-3, atol=1e-6)
    if max_norm == 100.0 and norm_type != 0.5:
        assert all(torch.equal(a, b) for a, b in zip(kept, [g for g in grads if g is not None]))  # no clipping


@pytest.mark.parametrize("mode", ["eager", "scripted"])
def test_empty_and_all_none(mode):
    fn = funcopt.clip_grad_norm_ if mode == "eager" else torch.jit.script(funcopt.clip_grad_norm_)
    want = torch.nn.utils.clip_grad_norm_([], 1.0)
    for grads in ([], [None, None]):
        total = fn(grads, 1.0)
        assert torch.equal(total, want) and total.dtype == want.dtype


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0])
def test_nonfinite_error_text(mode, norm_type):
    bad = [torch.tensor([float("nan"), 1.0]), torch.ones(2)]
    with pytest.raises(RuntimeError) as theirs:
        _torch_clip(bad, 1.0, norm_type, True)
    fn = funcopt.clip_grad_norm_ if mode == "eager" else torch.jit.script(funcopt.clip_grad_norm_)
    mine = [g.clone() for g in bad]
    with pytest.raises((RuntimeError, torch.jit.Error)) as e:
        fn(mine, 1.0, norm_type, True)
    assert str(theirs.value) in str(e.value)
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
               for a, b in zip(mine, bad)), "an error leaves the gradients as they were"
    # without the flag: scaled by the non-finite norm, as torch does
    want_total, want = _torch_clip(bad, 1.0, norm_type)
    mine = [g.clone() for g in bad]
    total = fn(mine, 1.0, norm_type, False)
    assert torch.allclose(total, want_total, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(mine, want):
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def test_scripted_train_step_with_funcopt_step():
    """One scripted module that clips and steps a funcopt core (docs/migration.md's pattern)."""
    params = [torch.randn(3, 2, requires_grad=True), torch.randn(4, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in params]

    class TrainStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.opt = funcopt.SGD(params, lr=0.1, momentum=0.9).core

        def forward(self, grads: List[Optional[Tensor]]) -> Tensor:
            total = funcopt.clip_grad_norm_(grads, 0.5)
            self.opt.step(grads, None, None)
            return total

    step = torch.jit.script(TrainStep())
    topt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) * 4 for p in params]
        total = step([g.clone() for g in grads])
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        topt.step()
        assert torch.equal(total, want) and total > 0.5
    # bitwise in a fresh process; after tests/test_backward.py has run in the same
    # process the last parameter step differs by float32 rounding (not understood
    # yet: noted in the issue 11 closing note), hence float32 tolerance here
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_exported_at_top_level():
    assert "clip_grad_norm_" in funcopt.__all__
    assert funcopt.clip_grad_norm_ is __import__("funcopt.clip", fromlist=["x"]).clip_grad_norm_

"""The parity case shared by the elementwise rules whose oracle is pytorch_optimizer's
(``tests/optimizers/test_adopt.py``, ``test_ademamix.py``): the same parameters on both
sides, the same gradients with ``None`` in them, the oracle stepped through ``p.grad``, and
parameters, param groups and state compared bitwise."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

import funcopt


def make_params(dtype: torch.dtype, seed: int = 0) -> List[torch.Tensor]:
    """Built afresh for each side (strides included): a matrix, a vector, a 0-d
    and an empty tensor, a transposed and a strided (sliced) one."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, dtype=dtype, generator=g) for s in [(7, 3), (5,), (), (0,)]]
    out.append(torch.randn(4, 6, dtype=dtype, generator=g).t())
    out.append(torch.randn(6, 8, dtype=dtype, generator=g)[:, ::2])
    assert not out[-1].is_contiguous() and not out[-2].is_contiguous()
    return [p.requires_grad_() for p in out]


def make_grads(params: Sequence[torch.Tensor], step: int, gen: torch.Generator) -> List[Optional[torch.Tensor]]:
    """Step ``step``'s gradients: the vector's first arrives at step 6 (not the group's first
    step), the transposed matrix has none at step 10."""
    gs: List[Optional[torch.Tensor]] = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    if step < 5:
        gs[1] = None
    if step == 9:
        gs[4] = None
    return gs


def oracle_step(opt: Any, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """The oracle's step through ``p.grad`` (clones: it writes into them)."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    opt.step()


def assert_same(fo: Any, ref: Any, fparams: Sequence[torch.Tensor], rparams: Sequence[torch.Tensor],
                slots: Sequence[str], exact: bool = True) -> None:
    """Parameters, param groups and every state entry (in ``slots``' order) equal: bitwise, or
    within rtol 1e-5 / atol 1e-6 (``exact=False``)."""
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    for i, (a, b) in enumerate(zip(fparams, rparams)):
        assert same(a.detach(), b.detach()), (i, (a - b).abs().max() if a.numel() else a)
    fs, rs = fo.state_dict(), ref.state_dict()
    assert fs["param_groups"] == rs["param_groups"]
    assert fs["state"].keys() == rs["state"].keys()
    for i, entry in rs["state"].items():
        assert list(fs["state"][i]) == list(entry) == list(slots)
        for k, v in entry.items():
            got = fs["state"][i][k]
            assert got.dtype == v.dtype and got.shape == v.shape, (i, k)
            assert same(got, v), (i, k, got, v)


def parity(fcls: type, ocls: type, slots: Sequence[str], cfg: Dict[str, Any], dtype: torch.dtype, mode: str,
           steps: int) -> None:
    """``steps`` steps of ``fcls`` (eager or ``funcopt.script``-ed) and of the oracle ``ocls``
    with ``cfg``: equal every step's counter, bitwise at the end; funcopt never writes into
    the caller's gradients, and the parameters moved."""
    fparams, rparams = make_params(dtype), make_params(dtype)
    fo, ref = fcls(fparams, **cfg), ocls(rparams, **cfg)
    if mode == "scripted":
        funcopt.script(fo)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        grads = make_grads(fparams, step, gen)
        kept = [None if g is None else g.clone() for g in grads]
        fo.step(grads)
        for g, k in zip(grads, kept):
            assert (g is None and k is None) or torch.equal(g, k)
        oracle_step(ref, rparams, grads)
        assert fo.param_groups[0].get("step", 0) == ref.param_groups[0].get("step", 0) == step + 1
    assert_same(fo, ref, fparams, rparams, slots)
    assert not torch.equal(fparams[0].detach(), make_params(dtype)[0].detach())  # it moved

"""ZeRO and the RPC optimizer on a torch that refuses to script.

Both script their local funcopt optimizer.  Where ``torch.jit.script`` does not
work (funcopt's probe, :func:`funcopt._compat.scripting_unavailable`, says so),
they step the same funcopt optimizer eagerly: the same numbers as the scripted
run (bitwise: the same kernels) and as ``torch.optim``, with one
``EagerFallbackWarning`` per process, never silently.

How "unavailable" is simulated: in this process (W=1), ``torch.jit.script`` is
monkeypatched to raise, as in a release that removed TorchScript, and the
probe's cached answer is cleared, so the probe itself finds scripting broken.
No environment variable is involved.  W=1 runs in-process: a gloo group of one
rank (``file://`` rendezvous in the test's tmp dir) for ZeRO, one TensorPipe RPC
worker that owns the parameters for ``DistributedOptimizer``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402

from funcopt import _compat  # noqa: E402
from funcopt.distributed import DistributedOptimizer, ZeroRedundancyOptimizer  # noqa: E402
from funcopt.distributed import _local  # noqa: E402
from funcopt.distributed import EagerFallbackWarning  # noqa: E402

pytestmark = pytest.mark.timeout(300)
STEPS = 4
HYPER = dict(lr=0.05)


@pytest.fixture
def refusing_torch(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``torch.jit.script`` raises (as in a release without TorchScript); funcopt's probe sees it."""
    calls: List[int] = []

    def removed(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("TorchScript has been removed from this release")

    _compat._probe_scripting.cache_clear()
    monkeypatch.setattr(torch.jit, "script", removed)
    monkeypatch.setattr(_local, "_WARNED", set())  # "once per process" starts afresh for this test
    yield calls
    monkeypatch.undo()
    _compat._probe_scripting.cache_clear()


def _params() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(6, 5, generator=g).requires_grad_(), torch.randn(7, generator=g).requires_grad_()]


def _loss(params: List[torch.Tensor], k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + k)
    return sum(((p * torch.randn(p.shape, generator=g)).sum() ** 2) for p in params)


def _torch_run() -> List[torch.Tensor]:
    params = _params()
    opt = torch.optim.Adam(params, **HYPER)
    for k in range(STEPS):
        opt.zero_grad()
        _loss(params, k).backward()
        opt.step()
    return [p.detach().clone() for p in params]


def _close(got: List[torch.Tensor], want: List[torch.Tensor], exact: bool, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        if exact:
            assert torch.equal(a, b), f"{what}: param {i} differs by {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what}: param {i}: {m}")


# ------------------------------------------------------------------ ZeRO
def _zero_run(stage: int) -> tuple:
    params = _params()
    opt = ZeroRedundancyOptimizer(params, torch.optim.Adam, zero_stage=stage, **HYPER)
    for k in range(STEPS):
        opt.zero_grad()
        _loss(params, k).backward()
        opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_falls_back_to_eager_with_the_same_numbers(gloo_world_of_one, refusing_torch, stage):
    with _compat_unpatched(refusing_torch):
        scripted, opt = _zero_run(stage)
        assert opt.scripted
    calls_before = len(refusing_torch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager, opt = _zero_run(stage)
        again, _ = _zero_run(stage)  # a second optimizer: no second warning
    assert not opt.scripted
    ours = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    msg = str(ours[0].message)
    assert msg.startswith("funcopt: ZeroRedundancyOptimizer steps its local optimizer eagerly"), msg
    assert torch.__version__ in msg and "removed" in msg, msg
    assert len(refusing_torch) == calls_before + 1, "only the probe may try to script"
    _close(eager, scripted, exact=True, what="eager fallback vs scripted ZeRO")
    _close(again, scripted, exact=True, what="second eager optimizer vs scripted ZeRO")
    _close(eager, _torch_run(), exact=False, what="eager fallback vs torch.optim.Adam")


class _compat_unpatched:
    """Run a block with the real ``torch.jit.script`` (the fixture's patch lifted)."""

    def __init__(self, calls: List[int]):
        self.calls = calls

    def __enter__(self) -> None:
        self.patched = torch.jit.script
        torch.jit.script = _REAL_SCRIPT
        _compat._probe_scripting.cache_clear()

    def __exit__(self, *exc: Any) -> None:
        torch.jit.script = self.patched
        _compat._probe_scripting.cache_clear()


_REAL_SCRIPT: Callable[..., Any] = torch.jit.script


# ------------------------------------------------------------------- RPC
def _rpc_run() -> List[torch.Tensor]:
    params = _params()
    opt = DistributedOptimizer(torch.optim.Adam, [rpc.RRef(p) for p in params], **HYPER)
    for k in range(STEPS):
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [_loss(params, k)])
            opt.step(cid)
    return [p.detach().clone() for p in params]


def test_rpc_falls_back_to_eager_with_the_same_numbers(rpc_world_of_one, refusing_torch):
    with _compat_unpatched(refusing_torch):
        scripted = _rpc_run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = _rpc_run()
        again = _rpc_run()
    ours = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert str(ours[0].message).startswith("funcopt: DistributedOptimizer steps its local optimizer eagerly")
    _close(eager, scripted, exact=True, what="eager fallback vs scripted DistributedOptimizer")
    _close(again, scripted, exact=True, what="second eager DistributedOptimizer vs scripted")
    _close(eager, _torch_run(), exact=False, what="eager fallback vs torch.optim.Adam")

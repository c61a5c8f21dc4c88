"""ZeRO-3 sharded checkpoints: save at W=4, load at W=2 and W=3, training continues identically.

``save_sharded`` / ``load_sharded`` of a ZeRO-3 root go through the same
checkpoint layer as ZeRO-1/2 (DCP, one commit record, all-or-nothing).  One
spawn saves at W=4 (trains 3 steps, saves with and without the optimizer,
trains 3 more: the uninterrupted run); one spawn per W in (2, 3) (W=3 in the rest
tier, tests/conftest.py REST) loads into a
fresh model and trains the same 3 steps.  The loaded model equals the saved
one exactly; the continued training equals the uninterrupted run (1e-5
relative: the gradient reduction order differs with W).  A broken or foreign
checkpoint fails with the same ``DistributedError`` on every rank, in bounded
time, and changes nothing.  Cases: Sequential stacks (frozen layers, a layer
with only frozen parameters, uneven padding), ``zero3(wrap=...)`` with a
buffer; funcopt eager / scripted and ``torch.optim`` optimizers.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_zero3_ckpt_work as C  # noqa: E402
from _dist_harness import assert_sd_close as _assert_sd_close, case_result, load_all, spawn  # noqa: E402

SPAWN_DEADLINE = 300.0
pytestmark = pytest.mark.timeout(int(3 * SPAWN_DEADLINE + 120))
RTOL, ATOL = 1e-5, 1e-6
assert_sd_close = functools.partial(_assert_sd_close, rtol=RTOL, atol=ATOL)  # this file's tolerances by default
_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    """run(role, world) -> (SpawnResult, results); the W=4 save runs first, once."""
    root = dist_tmp / "zero3-ckpt"

    def get(role: str, world: int):
        if ("save", 4) not in _RUNS:
            root.mkdir(parents=True, exist_ok=True)
            s = spawn(C.worker, 4, dist_tmp / "zero3-ckpt-save", "save", str(root), deadline=SPAWN_DEADLINE)
            _RUNS[("save", 4)] = (s, load_all(s))
        if (role, world) not in _RUNS:
            s = spawn(C.worker, world, dist_tmp / f"zero3-ckpt-{role}-w{world}", role, str(root),
                      deadline=SPAWN_DEADLINE)
            _RUNS[(role, world)] = (s, load_all(s))
        return _RUNS[(role, world)]
    return get


def _get(run, role, world, name, rank=0):
    spawned, results = run(role, world)
    return case_result(spawned, results, name, rank)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(C.BY_NAME))
def test_save_w4_load_and_continue(run, world, name):
    saved = _get(run, "save", 4, name)
    got = _get(run, "load", world, name)
    assert saved["at_save"], "rank 0 gathered nothing"
    assert_sd_close(got["loaded"], saved["at_save"], f"{name}: loaded at W={world}", rtol=0, atol=0)
    assert_sd_close(got["model_only"], saved["at_save"], f"{name}: model-only checkpoint at W={world}",
                    rtol=0, atol=0)
    # the optimizer state came back too: the continued run is the uninterrupted one
    assert_sd_close(got["final"], saved["final"], f"{name}: {C.MORE} steps after loading at W={world}")
    moved = max((saved["final"][k] - saved["at_save"][k]).abs().max().item() for k in saved["final"])
    assert moved > 1e-4, "training after the save changed nothing: the comparison would prove nothing"


FAULTS = {
    "truncated-shard": r"__2_0\.distcp has \d+ bytes, the commit record says",
    "missing-shard": r"missing \['__3_0\.distcp'\]",
    "edited-piece": r"__1_0\.distcp does not match the commit record",
    "no-commit": r"no committed save",
    "other-model": r"another model",
    "other-optimizer": r"checkpoint is for Adam, optimizer is SGD",
    "no-optimizer-state": r"holds no optimizer state",
    "zero3-into-zero": r"holds a ZeRO-3 model checkpoint .*this is a ZeRO-1/2 optimizer",
}


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_bad_checkpoint_fails_everywhere_changes_nothing(run, kind):
    messages = []
    for r in range(2):
        res = _get(run, "corrupt", 2, kind, rank=r)
        assert res["type"] == "DistributedError", f"rank {r}: {res['type']}: {res['error']}"
        assert re.search(FAULTS[kind], res["error"]), f"rank {r}: message does not name the problem: {res['error']}"
        assert res["seconds"] < 30, f"rank {r} took {res['seconds']:.1f}s"
        if "unchanged" in res:
            assert res["unchanged"], f"rank {r}: the model or optimizer changed after a failed load"
        messages.append(res["error"])
    assert len(set(messages)) == 1, "every rank should report the same (gathered) error"

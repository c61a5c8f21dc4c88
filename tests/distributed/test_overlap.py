"""The step inside backward under DDP: funcopt.distributed.ddp_step_hook.

One spawn per world size (1, 2, 4 gloo ranks) runs every case of
``_dist_overlap_work`` inside the ranks; each case trains a reference (DDP +
``optimizer.step()``) next to the hooked copy and reports the first
parameter or state that is not bitwise equal.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_overlap_work as W  # noqa: E402
from _dist_harness import case_result, load_all, spawn  # noqa: E402

SPAWN_DEADLINE = 240.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 60))
WORLDS = [1, 2, 4]
CASES = W.cases()
_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    def get(world):
        if world not in _RUNS:
            spawned = spawn(W.work, world, dist_tmp / f"overlap-w{world}", deadline=SPAWN_DEADLINE)
            _RUNS[world] = (spawned, load_all(spawned))
        return _RUNS[world]
    return get


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_ddp_step_hook_bitwise(run, world, name):
    spawned, results = run(world)
    trainable = {"l1.weight", "l1.bias", "l2.weight", "l2.bias", "side.weight", "side.bias",
                 "head.weight", "head.bias"}
    for rank in range(world):
        res = case_result(spawned, results, name, rank)
        assert res["mismatch"] is None, f"rank {rank}: {res['mismatch']}"
        assert set(res["moved"]) == trainable, res["moved"]  # frozen and never-used stay put
        assert res["buckets"] > W.STEPS  # several buckets per iteration (DDP: one at first)
        if name == "scaler":
            assert res["skipped"] == [0.0, 0.0, 1.0, 0.0, 0.0], res["skipped"]
    spawned.check()

"""Sharded checkpoints are published atomically, and a save that fails fails everywhere.

A process that commits a save and is then SIGKILLed while writing the next one
(``_dist_ckpt_fault_work.killed_save``), then one spawn of 2 ranks
(``_dist_ckpt_fault_work.worker``) that loads it and, for each crash point and
each failure, commits a save A, attempts a save B over it, and loads the
directory.  The states compared are the consolidated ``torch.optim``-format
states of the saving optimizer (bitwise: a checkpoint round trip copies).
"""
from __future__ import annotations

import multiprocessing
import re
import signal

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_ckpt_fault_work as F  # noqa: E402
from _dist_harness import assert_state_dict_close, case_result, load_all, spawn  # noqa: E402

from funcopt.distributed.checkpoint import COMMIT, TMP_PREFIX  # noqa: E402

SPAWN_DEADLINE = 180.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 120))
_RUN: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    if not _RUN:
        out = dist_tmp / "ckpt-faults"
        out.mkdir()
        child = multiprocessing.get_context("spawn").Process(target=F.killed_save, args=(str(out),))
        child.start()
        child.join(90)
        if child.is_alive():  # our own child, by handle
            child.kill()
            child.join(10)
        killed_code = child.exitcode
        spawned = spawn(F.worker, 2, out, deadline=SPAWN_DEADLINE, own=True)  # faults: its own processes
        _RUN["x"] = (spawned, load_all(spawned), killed_code, out)
    return _RUN["x"]


def _get(run, name, rank=0):
    return case_result(run[0], run[1], name, rank)


def _same(got, want, what):
    assert_state_dict_close(got, want, what, rtol=0, atol=0)


def _saves(files):
    return [f for f in files if f.startswith("save-")]


def test_spawn_clean(run):
    run[0].check()


def test_killed_mid_write_leaves_the_old_save(run):
    """SIGKILL after DCP wrote the new data file (no .metadata, no commit): the directory still
    holds the old save, which loads (here at another world size) exactly; the next save clears
    what the dead one left."""
    spawned, results, killed_code, out = run
    assert killed_code == -signal.SIGKILL, f"the saving process should have been killed, exit code {killed_code}"
    res = _get(run, "killed")
    assert any(f.startswith(TMP_PREFIX) for f in res["before"]), res["before"]
    assert res["loaded"]["type"] is None, res["loaded"]["error"]
    _same(res["loaded"]["sd"], torch.load(out / "killed-A.pt", weights_only=False), "loaded after the kill")
    assert res["after"] == sorted([COMMIT] + _saves(res["after"])) and len(_saves(res["after"])) == 1, res["after"]


def test_saved_by_a_subgroup_whose_rank_0_is_not_global_rank_0(run):
    """The group of global rank 1 alone saves (publishing is its rank 0's job); both ranks load it."""
    saved = _get(run, "subgroup", 1)
    assert saved["files"] == sorted([COMMIT] + _saves(saved["files"])) and len(_saves(saved["files"])) == 1
    for r in range(2):
        assert _get(run, "subgroup", r)["loaded"]["type"] is None, _get(run, "subgroup", r)["loaded"]["error"]
    _same(_get(run, "subgroup", 0)["loaded"]["sd"], saved["A"], "loaded")


@pytest.mark.parametrize("point", sorted(F.CRASHES))
def test_crash_leaves_old_or_new_never_a_mix(run, point):
    """A save that dies at any point leaves exactly one committed save, the old one until the
    commit record is replaced and the new one after; it loads bitwise."""
    res = _get(run, f"crash-{point}")
    assert res["raised"] is not None, "the injected crash did not happen"
    want = F.CRASHES[point][1]
    for r in range(2):
        loaded = _get(run, f"crash-{point}", r)["loaded"]
        assert loaded["type"] is None, f"rank {r}: {loaded['error']}"
    _same(res["loaded"]["sd"], res[want], f"{point}: loaded")
    other = "B" if want == "A" else "A"
    with pytest.raises(AssertionError):
        _same(res["loaded"]["sd"], res[other], "the other save")  # the two states do differ


FAILURE_MESSAGES = {
    "disk-full-on-rank-1": r"rank 1.*File too large",
    "exception-on-rank-1": r"rank 1: RuntimeError: injected on rank 1",
    "permission-on-rank-0": r"rank 0: PermissionError: .*Permission denied",
    "path-is-a-file": r"rank 0: FileExistsError",
}


@pytest.mark.parametrize("kind", F.FAILURES)
def test_failure_on_one_rank_fails_everywhere_keeps_the_old_save(run, kind):
    """Full disk, an exception or a permission error on one rank: every rank raises the same
    DistributedError within seconds (not the 30 s collective timeout); the unpublished save is
    removed; the previous save is still the committed one and loads bitwise."""
    msgs = []
    for r in range(2):
        res = _get(run, kind, r)
        save = res["save"]
        assert save["type"] == "DistributedError", f"rank {r}: {save['type']}: {save['error']}"
        assert re.search(FAILURE_MESSAGES[kind], save["error"]), f"rank {r}: {save['error']}"
        assert save["seconds"] < 10, f"rank {r} took {save['seconds']:.1f}s to fail"
        msgs.append(save["error"])
        assert res["loaded"]["type"] is None, f"rank {r}: {res['loaded']['error']}"
    assert msgs[0] == msgs[1], "every rank should report the same (gathered) error"
    res = _get(run, kind, 0)
    assert not any(f.startswith(TMP_PREFIX) for f in res["files"]), res["files"]
    assert res["files"] == sorted([COMMIT] + _saves(res["files"])) and len(_saves(res["files"])) == 1, res["files"]
    _same(res["loaded"]["sd"], res["A"], f"{kind}: loaded")

"""Sharded ZeRO checkpoints: save at one world size, load at another, continue training.

One spawn of 4 ranks (``_dist_ckpt_work.worker``); worlds of size 1 and 2 are
the process groups of ranks [0, 1) and [0, 2) inside it.  Every resumed run is
compared with an uninterrupted single-process ``torch.optim`` run.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_ckpt_work as C  # noqa: E402
import _dist_zero_work as Z  # noqa: E402
from _dist_harness import (Net, assert_state_dict_close, assert_tensors_close, case_result, load_all,  # noqa: E402
                           snapshot, spawn)

from funcopt.distributed.checkpoint import shard_name  # noqa: E402

SPAWN_DEADLINE = 240.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 60))
_RUN: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    if not _RUN:
        spawned = spawn(C.worker, 4, dist_tmp / "ckpt", deadline=SPAWN_DEADLINE)
        _RUN["x"] = (spawned, load_all(spawned))
    return _RUN["x"]


def _get(run, name, rank=0):
    return case_result(run[0], run[1], name, rank)


@functools.lru_cache(maxsize=None)
def reference(name: str):
    t = next(t for t in C.TRANSITIONS if t["name"] == name)
    case = C.case_of(t)
    model = Net(**case["model"])
    opt = Z.torch_class(case)(model.parameters(), **case["hyper"])
    Z.train(case, model, opt, range(0, C.TOTAL))
    return snapshot(model.parameters()), opt.state_dict()


def test_spawn_clean(run):
    spawned, results = run
    spawned.check()


T_IDS = [t["name"] for t in C.TRANSITIONS]


@pytest.mark.parametrize("t", C.TRANSITIONS, ids=T_IDS)
def test_resume_at_other_world_size(run, t):
    """save at W1 after 4 steps, load at W2, 3 more steps == 7 uninterrupted torch.optim steps."""
    ref_params, ref_sd = reference(t["name"])
    res = _get(run, t["name"], 0)
    what = f"{t['save']} ranks -> {t['load']} ranks"
    assert_tensors_close(res["params"], ref_params, f"{what}: params")
    assert_state_dict_close(res["sd"], ref_sd, f"{what}: consolidated state")
    for r in range(1, t["load"]):
        other = _get(run, t["name"], r)["params"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], other)), f"rank {r} params differ"
    for r in range(t["load"]):
        assert _get(run, t["name"], r)["lrs_after_load"] == [Z.HYPER[t["algo"]][0]["lr"]], \
            "load_sharded must restore the checkpoint's hyperparameters"


@pytest.mark.parametrize("t", C.TRANSITIONS, ids=T_IDS)
def test_checkpoint_files(run, t):
    """meta.pt plus one shard per saving rank (and the test's own params.pt)."""
    files = _get(run, t["name"], 0)["files"]
    assert files == sorted(["meta.pt", "params.pt"] + [shard_name(r, t["save"]) for r in range(t["save"])])


RESTRICTED = [t for t in C.TRANSITIONS if t["restrict"]]


@pytest.mark.parametrize("t", RESTRICTED, ids=[t["name"] for t in RESTRICTED])
def test_each_rank_reads_only_the_shards_it_needs(run, t):
    """Each loading rank loaded from a directory holding only meta.pt and the old shards whose
    flat ranges meet its new range (any other read would have failed with "missing shard"),
    and still resumed exactly (test_resume_at_other_world_size)."""
    numels = [p.numel() for p in Net(**t["model"]).parameters()]
    for r in range(t["load"]):
        needed = _get(run, t["name"], r)["needed"]
        assert needed, f"rank {r} needs some shard"
        if t["save"] == t["load"] and not t["model"]:
            assert needed == [r], f"rank {r} of an unchanged single-dtype layout needs only its own shard"
    if t["name"] == "4to2":  # 143 elements: old ranges of 36, new of 72
        assert [_get(run, "4to2", r)["needed"] for r in range(2)] == [[0, 1], [2, 3]], numels


CORRUPT = {
    # name: what the message must name
    "truncated-shard": r"corrupt shard .*shard-00002-of-00004",
    "garbage-shard": r"corrupt shard .*shard-00000-of-00004",
    "missing-shard": r"missing shard .*shard-00003-of-00004",
    "other-model": r"another model|parameters differ",
    "meta-of-other-model": r"another model|parameters differ",
    "shard-of-other-checkpoint": r"shard-00001-of-00004\.pt does not belong",
    "shard-of-other-world-size": r"shard-00001-of-00004\.pt does not belong",
    "bogus-meta": r"corrupt checkpoint metadata",
    "foreign-meta": r"not a funcopt sharded checkpoint",
    "missing-dir": r"missing checkpoint metadata",
    "good-into-sgd": r"checkpoint is for Adam, optimizer is SGD",
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_bad_checkpoint_fails_everywhere_changes_nothing(run, name):
    """DistributedError on every rank -- also when only one rank reads the bad file -- naming the
    problem; the optimizer (state, hyperparameters, parameters) is left as it was."""
    messages = []
    for r in range(4):
        res = _get(run, "corrupt", r)[name]
        assert res["type"] == "DistributedError", f"rank {r}: {res['type']}: {res['error']}"
        assert re.search(CORRUPT[name], res["error"]), f"rank {r}: message does not name the problem: {res['error']}"
        assert res["seconds"] < 10, f"rank {r} took {res['seconds']:.1f}s"
        messages.append(res["error"])
        assert res["unchanged"]["lrs"] == res["before"]["lrs"], f"rank {r}: hyperparameters changed"
        assert all(torch.equal(a, b) for a, b in zip(res["unchanged"]["params"], res["before"]["params"]))
    assert len(set(messages)) == 1, "every rank should report the same (gathered) error"
    res = _get(run, "corrupt", 0)[name]
    assert_state_dict_close(res["unchanged"]["sd"], res["before"]["sd"], f"{name}: state after the failed load",
                            rtol=0, atol=0)

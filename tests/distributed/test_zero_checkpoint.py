"""Sharded ZeRO checkpoints: save at one world size, load at another, continue training;
convert offline to a torch.optim state dict; reject every damaged or foreign checkpoint.

One spawn of 4 ranks (``_dist_ckpt_work.worker``); worlds of size 1 and 2 are
the process groups of ranks [0, 1) and [0, 2) inside it.  Every resumed run is
compared with an uninterrupted single-process ``torch.optim`` run.  Atomicity
and faults while saving: ``test_checkpoint_atomic.py``.
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

from funcopt.distributed.checkpoint import COMMIT, committed_dir, to_torch_state_dict  # noqa: E402
from funcopt.distributed.layout import make_layout  # noqa: E402

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
    """The commit record, one DCP save directory (its metadata and one file per saving rank),
    and the test's own params.pt; nothing left of the temporary directory."""
    res = _get(run, t["name"], 0)
    assert [f for f in res["files"] if f not in (COMMIT, "params.pt")] == [f for f in res["files"] if f.startswith("save-")]
    assert len([f for f in res["files"] if f.startswith("save-")]) == 1, res["files"]
    assert COMMIT in res["files"]
    assert res["save_files"] == sorted([".metadata"] + [f"__{r}_0.distcp" for r in range(t["save"])])


def _elementwise_and_scalar(sd):
    """Per parameter id: (elementwise state tensors, 0-d state tensors)."""
    return {i: (sum(1 for v in e.values() if v.dim() > 0), sum(1 for v in e.values() if v.dim() == 0))
            for i, e in sd["state"].items()}


@pytest.mark.parametrize("t", C.TRANSITIONS, ids=T_IDS)
def test_each_rank_reads_only_its_part(run, t):
    """DCP reads for each loading rank exactly the elements of the ranges it owns now (and one
    copy of each 0-d counter of a parameter it holds a piece of): no rank reads the whole state."""
    _, ref_sd = reference(t["name"])
    counts = _elementwise_and_scalar(ref_sd)
    params = list(Net(**t["model"]).parameters())
    # a slot of its own shape (Adafactor's factored rows/columns) is read whole, by the
    # parameter's owner (a whole-parameter rule is placed whole: greedy)
    own = {i: sum(v.numel() for v in e.values() if v.dim() > 0 and v.numel() != params[i].numel())
           for i, e in ref_sd["state"].items()}
    counts = {i: (sum(1 for v in e.values() if v.dim() > 0 and v.numel() == params[i].numel()), counts[i][1])
              for i, e in ref_sd["state"].items()}
    layout = make_layout([p.numel() for p in params], [p.dtype for p in params], [len(params)], t["load"],
                         t["load_partition"])
    total = sum(p.numel() * counts[i][0] + counts[i][1] + own[i] for i, p in enumerate(params))
    for r in range(t["load"]):
        segs = layout.segments(r)
        want = (sum(s.length * counts[s.param][0] for s in segs)
                + sum(counts[i][1] + own[i] for i in {s.param for s in segs}))
        got = _get(run, t["name"], r)["read_elements"]
        assert got == want, f"rank {r} read {got} state elements, owns {want} (whole state: {total})"
        if t["load"] > 1:
            assert got < total


@pytest.mark.parametrize("t", C.TRANSITIONS, ids=T_IDS)
def test_converts_offline_to_a_torch_optim_state_dict(run, dist_tmp, tmp_path, t):
    """DCP's own dcp_to_torch_save (no process group) plus to_torch_state_dict give the
    consolidated torch.optim state of the saving optimizer, which a torch.optim optimizer loads."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    saved = _get(run, t["name"], 0)["saved_sd"]
    out = tmp_path / "opt.pt"
    dcp_to_torch_save(committed_dir(str(dist_tmp / "ckpt" / f"ck-{t['name']}")), out)
    converted = to_torch_state_dict(torch.load(out, weights_only=False))
    assert_state_dict_close(converted, saved, f"{t['name']}: converted", rtol=0, atol=0)
    case = C.case_of(t)
    model = Net(**case["model"])
    opt = Z.torch_class(case)(model.parameters(), **dict(case["hyper"], lr=123.0))
    opt.load_state_dict(converted)
    assert_state_dict_close(opt.state_dict(), saved, f"{t['name']}: torch.optim after load_state_dict",
                            rtol=0, atol=0)


CORRUPT = {
    # name: what the message must name
    "truncated-shard": r"__2_0\.distcp has \d+ bytes, the commit record says",
    "edited-piece": r"rank 3: .*__2_0\.distcp does not match the commit record",
    "edited-metadata": r"\.metadata does not match the commit record",
    "garbage-shard": r"__0_0\.distcp has 1000 bytes",
    "missing-shard": r"missing \['__3_0\.distcp'\]",
    "extra-file": r"unexpected \['__7_0\.distcp'\]",
    "other-model": r"another model|parameters differ",
    "shard-of-other-save": r"__1_0\.distcp (does not match the commit record|has \d+ bytes)",
    "record-of-other-save": r"the committed save .* is missing",
    "save-of-other-checkpoint": r"holds save '[0-9a-f]+', the commit record names",
    "forged-shard": r"torch\.distributed\.checkpoint failed",
    "bogus-record": r"malformed commit record",
    "record-wrong-types": r"malformed commit record .*bad files",
    "record-escapes": r"malformed commit record .*dir does not name the save",
    "foreign-record": r"malformed commit record .*format 'someone-else-v3'",
    "uncommitted": r"no committed save",
    "old-format": r"old-format",
    "missing-dir": r"no committed save",
    "good-into-sgd": r"checkpoint is for Adam, optimizer is SGD",
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_bad_checkpoint_fails_everywhere_changes_nothing(run, name):
    """DistributedError on every rank -- also when only one rank checks the bad file -- naming the
    problem (never AttributeError/KeyError); the optimizer (state, hyperparameters, parameters)
    is left as it was."""
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

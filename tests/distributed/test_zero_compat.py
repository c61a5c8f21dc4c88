"""ZeroRedundancyOptimizer as a drop-in: AMP with ZeRO-2, hyperparameter agreement, strided
parameters, optimizer classes funcopt has no algorithm for, Join with uneven inputs.

One spawn of 2 ranks runs every case (see ``_dist_zero_compat_work``); the tests
are assertions over its results.  Oracles: single-process ``torch.optim`` (run
here in the parent) and, for AMP, DDP + ``torch.optim`` + ``torch.amp.GradScaler``
run in the same ranks.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_zero_compat_work as W  # noqa: E402
from _dist_harness import assert_state_dict_close, assert_tensors_close, case_result, load_all, spawn  # noqa: E402

SPAWN_DEADLINE = 240.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 60))
WORLD = 2

_RUN: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    if "r" not in _RUN:
        spawned = spawn(W.worker, WORLD, dist_tmp / "zero-compat", W.CASES, deadline=SPAWN_DEADLINE)
        _RUN["r"] = (spawned, load_all(spawned))
    return _RUN["r"]


def _get(run, name, rank=0):
    spawned, results = run
    return case_result(spawned, results, name, rank)


def test_spawn_clean(run):
    spawned, results = run
    spawned.check()
    for r in range(WORLD):
        assert sorted(results[r]) == sorted(c["name"] for c in W.CASES)


# ---------------------------------------------------------------------- AMP
@pytest.mark.parametrize("case", W.AMP, ids=[c["name"] for c in W.AMP])
def test_grad_scaler_matches_ddp(run, case):
    """ZeRO (ZeRO-2: gradient shards) + GradScaler gives DDP + torch.optim + GradScaler's
    parameters after every step, the same scale sequence, and skips the step whose
    gradients hold an inf on one rank only, on every rank (step counters included)."""
    for r in range(WORLD):
        res = _get(run, case["name"], r)
        zero, ddp = res["zero"], res["ddp"]
        assert ddp["skipped"][W.INF_STEP] and sum(ddp["skipped"]) == 1, "the oracle must skip exactly one step"
        assert zero["skipped"] == ddp["skipped"], f"rank {r}: skipped steps {zero['skipped']} vs DDP {ddp['skipped']}"
        assert zero["scales"] == ddp["scales"], f"rank {r}: scales {zero['scales']} vs DDP {ddp['scales']}"
        for s, (got, want) in enumerate(zip(zero["params"], ddp["params"])):
            assert_tensors_close(got, want, f"rank {r} params after step {s}")
    res0 = _get(run, case["name"], 0)
    assert_state_dict_close(res0["zero"]["sd"], res0["ddp"]["sd"], "consolidated state vs DDP's torch.optim")


# ----------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("what,key", [("lr", "'lr'"), ("betas", "'betas'"), ("group-weight_decay", "'weight_decay'"),
                                      ("eager-momentum", "'momentum'"), ("add-group-lr", "'lr'")])
def test_different_hyperparameters_fail_everywhere(run, what, key):
    """A rank constructed (or adding a group) with another hyperparameter value:
    DistributedError on every rank naming the key, detected (not timed out)."""
    for r in range(WORLD):
        res = _get(run, "hyper", r)[what]
        assert res["type"] == "DistributedError", f"rank {r}: {res}"
        assert key in res["error"], f"rank {r}: the error does not name {key}: {res['error']}"
        assert res["seconds"] < 10, f"rank {r} took {res['seconds']:.1f}s"


def test_hyperparameter_check_accepts_equal_values_and_recovers(run):
    for r in range(WORLD):
        res = _get(run, "hyper", r)
        assert res["same-values"]["type"] is None, f"rank {r}: {res['same-values']}"
        assert res["groups-after"] == 1, f"rank {r}: a rejected add_param_group left {res['groups-after']} groups"
        assert res["add-group-ok"]["type"] is None and res["params-changed"]
        assert res["sparse"]["type"] == "ValueError", f"rank {r}: {res['sparse']}"


# --------------------------------------------------------------------- strided
@functools.lru_cache(maxsize=None)
def _strided_ref(name):
    return W.reference_strided(next(c for c in W.STRIDED if c["name"] == name))


@pytest.mark.parametrize("case", W.STRIDED, ids=[c["name"] for c in W.STRIDED])
def test_strided_parameters(run, case):
    """channels_last, transposed, sliced and 0-d parameters: torch.optim's numbers on every
    rank, every parameter keeps its strides and storage (the slice still views its base)."""
    ref = _strided_ref(case["name"])
    assert not all(c for _, c, _ in ref["layouts"]), "the model must have non-contiguous parameters"
    for r in range(WORLD):
        res = _get(run, case["name"], r)
        assert_tensors_close(res["params"], ref["params"], f"rank {r} params after {W.STEPS} steps")
        assert res["layouts"] == res["layouts_before"] == ref["layouts"], f"rank {r}: layouts changed"
        assert res["slice_shares"], f"rank {r}: the sliced parameter no longer views its base tensor"
        noncontig = [not c for _, c, _ in res["layouts"]]
        assert all(k for k, nc in zip(res["ptrs_kept"], noncontig) if nc), \
            f"rank {r}: a non-contiguous parameter moved to other storage"


# ----------------------------------------------------------------- eager class
@functools.lru_cache(maxsize=None)
def _eager_ref(name):
    return W.reference_eager(next(c for c in W.EAGER if c["name"] == name))


@pytest.mark.parametrize("case", W.EAGER, ids=[c["name"] for c in W.EAGER])
def test_optimizer_class_outside_the_registry(run, case):
    """A torch.optim class funcopt has no algorithm for runs eagerly over this rank's whole
    parameters (``optim`` holds them, ``optim.state[p]`` works), step kwargs reach it, and
    it gives torch.optim's numbers and state dict; the consolidated state reloads."""
    ref = _eager_ref(case["name"])
    numels = []
    for r in range(WORLD):
        res = _get(run, case["name"], r)
        assert_tensors_close(res["p5"], ref["p5"], f"rank {r} params after {W.STEPS} steps")
        assert_tensors_close(res["p7"], ref["p7"], f"rank {r} params after reloading and 2 more steps")
        assert res["local_is_params"] and res["state_keyed_by_param"]
        numels.append(res["local_numel"])
        assert res["flat-refused"]["type"] == "ValueError"
        if case["cls"] == "SGDWithKwarg":
            assert len(res["seen"]) == W.STEPS + 2  # the kwarg reached every local step
    assert sum(numels) == sum(p.numel() for p in W.Net().parameters()) and min(numels) > 0
    assert_state_dict_close(_get(run, case["name"], 0)["sd5"], ref["sd5"], "consolidated state")


# ------------------------------------------------------------------------ join
def test_join_uneven_inputs(run):
    """Rank 0 runs out of inputs first; under Join it keeps stepping its shard (ZeRO's join
    hook), so every rank ends with the parameters of the longest single-process run."""
    ref = W.reference_join()
    for r in range(WORLD):
        res = _get(run, "join", r)
        assert_tensors_close(res["params"], ref, f"rank {r} params after Join")
        assert res["z2_join"]["type"] == "NotImplementedError"

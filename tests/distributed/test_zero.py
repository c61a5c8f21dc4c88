"""ZeroRedundancyOptimizer (ZeRO-1 with DDP, ZeRO-2) against single-process torch.optim.

One spawn per world size (1, 2, 4) runs every case in order inside the ranks
and saves the results; the tests below are assertions over those files.  The
oracle is always ``torch.optim.<Name>`` on the full model and the full batch
(:func:`_dist_zero_work.reference`), run here in the parent.

World 4 loads torch.optim's own state dict into ZeRO; world 2 loads the state
consolidated by world 4, world 1 the one consolidated by world 2.
"""
from __future__ import annotations

import functools
import os
import re

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_zero_work as W  # noqa: E402
from _oracles import without_instance_keys  # noqa: E402
from funcopt.registry import REGISTRY  # noqa: E402
from _dist_harness import (assert_state_dict_close, assert_tensors_close, case_result, load_all,  # noqa: E402
                           spawn, state_tensor_bytes, state_tensors, tol)

SPAWN_DEADLINE = 240.0
# a test's time includes the spawns it triggers: at most three (world 1 loads world 2's state,
# which loads world 4's) when a selection starts with a world-1 test
pytestmark = pytest.mark.timeout(int(3 * SPAWN_DEADLINE + 60))
WORLDS = [4, 2, 1]

TRAIN = W.train_cases()
BY_NAME = {c["name"]: c for c in TRAIN}
# cases also loaded, through load_state_dict, into ZeRO at another world size
LOADED = ["SGD-flat", "Adam-greedy", "AdamW-flat-view", "Adagrad-greedy-view", "add-group", "mixed-dtype",
          "flip-trainable", "z2-adam-flat"]
LOAD_SOURCE = {4: "torch", 2: 4, 1: 2}


# Which (world size, case) pairs run.  Every case but the rules beyond torch's runs at W=2.  The algorithm x
# partition x bucket-view matrix runs in full at every world size for the
# algorithms with a fused kernel (their own code path per world size); the
# others share the foreach path, so at W=4 and W=1 each runs two of its
# variants, rotating (every algorithm at every world size, every variant at
# two; the rules beyond torch run two variants at W=2, flat with the oracle's class and the
# last (greedy, bucket view, two groups) with funcopt's; FUNCOPT_FULL_GRID=1 runs everything
# everywhere).
_MATRIX = {c["name"] for c in W.matrix_cases()}
_FULL = os.environ.get("FUNCOPT_FULL_GRID") == "1"


def runs_at(case, world: int) -> bool:
    name = case["name"]
    if _FULL or name not in _MATRIX:
        return True
    if world == 2 and case["algo"] not in W.BEYOND_TORCH:
        return True
    from funcopt.registry import REGISTRY

    spec = REGISTRY[case["algo"]]
    if "cpu" in spec.fused_devices:
        return True
    variant = [c["name"] for c in W.matrix_cases() if c["algo"] == case["algo"]].index(name)
    if case["algo"] in W.BEYOND_TORCH:  # the rules beyond torch: their first and last variant at W=2
        return world == 2 and variant in (0, len([c for c in W.matrix_cases() if c["algo"] == case["algo"]]) - 1)
    return variant % 2 == (0 if world == 4 else 1)


def world_cases(worlds, cases):
    return [pytest.param(w, c, id=f"{w}-{c['name']}") for w in worlds for c in cases if runs_at(c, w)]


def cases_for(world: int):
    cases = [c for c in TRAIN if runs_at(c, world)]
    cases += [dict(kind="load", name=f"load:{n}", case=BY_NAME[n]) for n in LOADED]
    cases += [c for c in W.ERROR_CASES if world > 1 or c["kind"] != "mismatch"]
    if world == 2:
        cases.append(dict(kind="count", name="z2-collective-count"))
    return cases


@functools.lru_cache(maxsize=None)
def reference(name: str, world: int = 1):
    return W.reference(BY_NAME[name], world)


_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    """run(world) -> (SpawnResult, {rank: {case: result}}), spawned once per world size."""
    def get(world: int):
        if world not in _RUNS:
            src = LOAD_SOURCE[world]
            if src == "torch":
                sources = {n: dict(p10=reference(n)["p10"], sd10=reference(n)["sd10"]) for n in LOADED}
            else:
                spawned, results = get(src)
                sources = {n: dict(p10=case_result(spawned, results, n)["p10"],
                                   sd10=case_result(spawned, results, n)["sd10"]) for n in LOADED}
            spawned = spawn(W.worker, world, dist_tmp / f"zero-w{world}", cases_for(world), sources,
                            deadline=SPAWN_DEADLINE)
            _RUNS[world] = (spawned, load_all(spawned))
        return _RUNS[world]
    return get


def _get(run, world, name, rank=0):
    spawned, results = run(world)
    return case_result(spawned, results, name, rank)


def _ids(cases):
    return [c["name"] for c in cases]


# ------------------------------------------------------------- the spawns
@pytest.mark.parametrize("world", WORLDS)
def test_spawn_clean(run, world):
    """Every rank ran every case and exited 0 before the deadline."""
    spawned, results = run(world)
    spawned.check()
    assert sorted(results) == list(range(world))
    for r in range(world):
        assert sorted(results[r]) == sorted(c["name"] for c in cases_for(world))


# ------------------------------------------------------------ vs torch.optim
def _as_oracle(sd, case, ref_sd):
    """``sd`` less the options an oracle outside torch keeps on its instance, not in its
    param groups (tests/_oracles.py; pytorch_optimizer's ``maximize``, SOAP's ``data_format``)."""
    spec = REGISTRY[case["algo"]]
    return dict(sd, param_groups=[without_instance_keys(spec, g, r)
                                  for g, r in zip(sd["param_groups"], ref_sd["param_groups"])])


@pytest.mark.parametrize("world,case", world_cases(WORLDS, TRAIN))
def test_matches_torch(run, world, case):
    """Params after 10 and 13 steps and the consolidated state (torch.optim format) equal torch.optim's."""
    ref = reference(case["name"], world)
    to = case["to"] % world
    at_to = _get(run, world, case["name"], rank=to)
    rank0 = _get(run, world, case["name"], rank=0)
    # state: atol 1e-6 (near-zero elements of momentum-like buffers differ by
    # rounding where gradients are averaged in another order, e.g. centered RMSprop at W=4)
    t, ts = tol(case["algo"]), tol(case["algo"], atol=1e-6)
    assert_tensors_close(rank0["p10"], ref["p10"], f"W={world} params after {W.STEPS} steps", **t)
    at_to, rank0 = dict(at_to, sd10=_as_oracle(at_to["sd10"], case, ref["sd10"])), \
        dict(rank0, sd13=_as_oracle(rank0["sd13"], case, ref["sd13"]))
    assert_state_dict_close(at_to["sd10"], ref["sd10"], f"W={world} consolidated state (to={to}) after {W.STEPS} steps",
                            **ts)
    assert_tensors_close(rank0["p13"], ref["p13"], f"W={world} params after {W.STEPS + W.CONT} steps", **t)
    assert_state_dict_close(rank0["sd13"], ref["sd13"], f"W={world} consolidated state after {W.STEPS + W.CONT} steps",
                            **ts)


@pytest.mark.parametrize("world,case", world_cases([4, 2], TRAIN))
def test_ranks_hold_same_params(run, world, case):
    """The all-gather leaves every rank with bitwise the same parameters."""
    p0 = _get(run, world, case["name"], 0)["p13"]
    for r in range(1, world):
        pr = _get(run, world, case["name"], r)["p13"]
        for i, (a, b) in enumerate(zip(p0, pr)):
            assert torch.equal(a, b), f"rank {r} param {i} differs from rank 0"


TORCH_CONTINUE = [c for c in TRAIN if c["torch_continue"]]


@pytest.mark.parametrize("world,case", world_cases(WORLDS, TORCH_CONTINUE))
def test_consolidated_loads_into_torch_optim(run, world, case):
    """The consolidated state dict loads into a plain torch.optim optimizer, which then
    continues like the ZeRO run did."""
    res = _get(run, world, case["name"], case["to"] % world)
    rank0 = _get(run, world, case["name"], 0)
    got = W.torch_continue(case, rank0["p10"], res["sd10"])
    assert_tensors_close(got, rank0["p13"], f"W={world} torch.optim continuing from the consolidated state vs ZeRO",
                         **tol(case["algo"]))


def test_consolidate_to_another_rank(run):
    spawned, results = run(4)
    for r in range(4):
        res = case_result(spawned, results, "consolidate-to-last", r)
        if r == 3:
            assert "sd10" in res
        else:
            assert "sd10" not in res
            assert res["state_dict_elsewhere"] is not None and "consolidate_state_dict" in res["state_dict_elsewhere"], \
                f"rank {r}: state_dict() without the consolidated state should raise RuntimeError"


@pytest.mark.parametrize("name", LOADED)
@pytest.mark.parametrize("world", WORLDS)
def test_load_state_dict_from_other_world_size(run, world, name):
    """ZeRO at ``world`` loads a state dict consolidated at another world size (or torch.optim's)
    and continues: equal to the uninterrupted single-process run."""
    ref = reference(name)
    res = _get(run, world, f"load:{name}", 0)
    assert_tensors_close(res["p13"], ref["p13"], f"W={world} loaded from {LOAD_SOURCE[world]}: params")
    assert_state_dict_close(res["sd13"], ref["sd13"], f"W={world} loaded from {LOAD_SOURCE[world]}: state")
    for r in range(1, world):
        other = _get(run, world, f"load:{name}", r)["p13"]
        assert all(torch.equal(a, b) for a, b in zip(res["p13"], other)), f"rank {r} params differ"


# ------------------------------------------------------------------ memory
def _elem_and_scalar_bytes(sd):
    elem = sum(t.numel() * t.element_size() for e in sd["state"].values() for t in e.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    scalar = state_tensor_bytes(sd) - elem
    return elem, scalar


@pytest.mark.parametrize("world,case", world_cases(WORLDS, TRAIN))
def test_state_not_replicated(run, world, case):
    """Summed over ranks, the sharded state is the unsharded state (plus at most one step
    counter per parameter cut between two ranks): nothing is held twice."""
    ref_sd = reference(case["name"])["sd10"]
    full = state_tensor_bytes(ref_sd)
    per_rank = [_get(run, world, case["name"], r)["state_bytes"] for r in range(world)]
    n_scalar_slots = len({k for e in ref_sd["state"].values() for k, v in e.items()
                          if not isinstance(v, (list, tuple)) and [t.dim() for t in state_tensors(v, k)] == [0]})
    n_spaces = len({p.dtype for p in W.make_model(case).parameters()})
    dup = 4 * n_scalar_slots * (world - 1) * n_spaces if case["partition"] == "flat" else 0
    assert full <= sum(per_rank) <= full + dup, f"per-rank state bytes {per_rank}, unsharded {full}"


MEM = [c for c in TRAIN if c["name"].startswith("mem-")]


@pytest.mark.parametrize("world,case", world_cases(WORLDS, MEM))
def test_state_bytes_per_rank(run, world, case):
    """Each rank holds 1/W of the state: flat partitions within padding of exactly 1/W,
    greedy ones within the largest parameter's state of it."""
    ref_sd = reference(case["name"])["sd10"]
    elem, scalar = _elem_and_scalar_bytes(ref_sd)
    numels = [p.numel() for p in W.make_model(case).parameters()]
    per_elem = elem // sum(numels)  # every parameter has state in these cases
    per_rank = [_get(run, world, case["name"], r)["state_bytes"] for r in range(world)]
    if case["partition"] == "flat":
        lo = elem / world - per_elem * (world - 1)
        hi = elem / world + per_elem + scalar
    else:
        lo = elem / world - per_elem * max(numels)
        hi = elem / world + per_elem * max(numels) + scalar
    for r, b in enumerate(per_rank):
        assert lo <= b <= hi, f"rank {r}: {b} bytes of state, expected within [{lo:.0f}, {hi:.0f}] (1/W = {elem / world:.0f})"


# ------------------------------------------------------------------- ZeRO-2
Z2 = [c for c in TRAIN if c["stage"] == 2]


@pytest.mark.parametrize("world,case", world_cases(WORLDS, Z2))
def test_zero2_holds_only_its_gradient_shard(run, world, case):
    """After backward (and after step) each rank holds ~1/W of the gradients (of the optimizer's
    parameters, frozen ones included: the shard has room for them) and no full gradient of a
    trainable parameter."""
    for r in range(world):
        res = _get(run, world, case["name"], r)
        assert len(res["grad_info"]) == W.STEPS + W.CONT
        for info in res["grad_info"]:
            full = sum(n * e for n, e, _ in info["params"])
            if case["partition"] == "flat":  # padding: less than one element per dtype space
                pad = sum({d: e for _, e, d in info["params"]}.values())
            else:  # greedy: the largest rank may exceed 1/W by up to the largest parameter
                pad = max(n * e for n, e, _ in info["params"])
            assert full / world <= info["shard_bytes"] <= full / world + pad, \
                f"rank {r} step {info['step']}: holds {info['shard_bytes']} gradient bytes, full {full}, W={world}"
            assert all(info["grads_none"]), \
                f"rank {r} step {info['step']}: p.grad kept for params {[i for i, n in enumerate(info['grads_none']) if not n]}"
        after = res["after_step"]
        assert after["shard_bytes"] <= full / world + pad and all(after["grads_none"])


def test_zero2_no_bucketing_is_per_tensor_not_per_element(run):
    """bucket_size_mb=0 disables bucketing: one step issues at most about one reduce-scatter and
    one all-gather per parameter (W=2, 143 elements in 6 tensors), not one per element."""
    res = _get(run, 2, "z2-collective-count", 0)
    # per parameter at most one reduce-scatter and one parameter sync, each at most one
    # collective per rank (e.g. W reduces / W broadcasts on gloo), plus a few for bookkeeping
    world = 2
    assert res["collectives"] <= 2 * world * res["n_params"] + 8, res


# ------------------------------------------------------------------- errors
BAD_LOADS = {"group-count": "param groups", "group-size": "params", "shape-last": "shape",
             "shape-first": "shape", "missing-key": "keys", "other-optimizer": "hyperparameters|keys"}


@pytest.mark.parametrize("what", sorted(BAD_LOADS))
@pytest.mark.parametrize("world", WORLDS)
def test_bad_load_state_dict_fails_everywhere_changes_nothing(run, world, what):
    for r in range(world):
        res = _get(run, world, "bad-load", r)["results"][what]
        # a DistributedError that is also the ValueError every failing rank raised
        assert res["type"] == "DistributedValueError", f"rank {r}: {res}"
        assert re.search(BAD_LOADS[what], res["error"]), f"rank {r}: message does not name the problem: {res['error']}"
    for r in range(world):
        res = _get(run, world, "bad-load", r)
        assert res["after"]["lrs"] == res["before"]["lrs"], f"rank {r}: lr changed by a failed load"
        assert all(torch.equal(a, b) for a, b in zip(res["after"]["params"], res["before"]["params"]))
    res = _get(run, world, "bad-load", 0)
    assert_state_dict_close(res["after"]["sd"], res["before"]["sd"], "state after failed loads", rtol=0, atol=0)


MISMATCHES = ["extra-param", "other-shape", "other-dtype", "other-class", "other-partition", "add-group-one-rank"]


@pytest.mark.parametrize("what", MISMATCHES)
@pytest.mark.parametrize("world", [4, 2])
def test_different_parameter_sets_fail_everywhere(run, world, what):
    """A rank constructing with other parameters: DistributedError on every rank, in bounded time
    (well under the 30 s collective timeout: detected, not timed out)."""
    for r in range(world):
        res = _get(run, world, "mismatch", r)[what]
        assert res["type"] == "DistributedError", f"rank {r}: {res}"
        assert res["seconds"] < 10, f"rank {r} took {res['seconds']:.1f}s"
    afterwards = [_get(run, world, "mismatch", r)["afterwards"] for r in range(world)]
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(afterwards[0], afterwards[r]))


@pytest.mark.parametrize("world", [4, 2])
def test_failed_add_param_group_changes_nothing(run, world):
    for r in range(world):
        res = _get(run, world, "mismatch", r)
        assert res["groups-after-failed-add"] == 1, \
            f"rank {r}: a rejected add_param_group left {res['groups-after-failed-add']} param groups"


OPTIONS = {"overlap_with_ddp+zero_stage=2": "ValueError", "overlap_with_ddp-step-without-hook": "RuntimeError",
           "zero_stage=3": "ValueError", "zero_stage=0": "ValueError",
           "partition=bogus": "ValueError", "bad-lr": "ValueError", "unknown-class": "TypeError"}


@pytest.mark.parametrize("what", sorted(OPTIONS))
@pytest.mark.parametrize("world", WORLDS)
def test_invalid_options(run, world, what):
    for r in range(world):
        res = _get(run, world, "options", r)[what]
        assert res["type"] == OPTIONS[what], f"rank {r}: {res}"

"""ZeroRedundancyOptimizer.clip_grad_norm (world sizes 1, 2, 4) and the algorithms that
need whole parameters (Adafactor, Muon: ``spec.whole_params``) through ZeRO at
world size 2, against single-process torch.optim (+ torch.nn.utils.clip_grad_norm_).

One spawn per world size runs every case (:mod:`_dist_whole_work`); the tests
are assertions over the saved results.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_whole_work as W  # noqa: E402
from _dist_harness import assert_tensors_close, case_result, load_all, spawn, state_tensors  # noqa: E402
from _oracles import without_instance_keys  # noqa: E402

from funcopt.registry import REGISTRY  # noqa: E402

SPAWN_DEADLINE = 240.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 60))
WORLDS = [1, 2, 4]
CLIP = W.clip_cases()
WHOLE = [c for c in W.whole_cases() if c["kind"] == "whole"]
REFUSE = [c for c in W.whole_cases() if c["kind"] == "refuse-flat"]
_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    def get(world: int):
        if world not in _RUNS:
            spawned = spawn(W.worker, world, dist_tmp / f"zero-clip-w{world}", W.cases_for(world),
                            deadline=SPAWN_DEADLINE)
            _RUNS[world] = (spawned, load_all(spawned))
        return _RUNS[world]
    return get


@functools.lru_cache(maxsize=None)
def reference(name: str):
    return W.reference({c["name"]: c for c in CLIP + WHOLE}[name])


@pytest.mark.parametrize("world", WORLDS)
def test_spawn_clean(run, world):
    spawned, results = run(world)
    spawned.check()
    assert sorted(results) == list(range(world))


@pytest.mark.parametrize("case", CLIP, ids=[c["name"] for c in CLIP])
@pytest.mark.parametrize("world", WORLDS)
def test_clip_grad_norm_matches_unsharded(run, world, case):
    """The norm every rank returns and the trained parameters equal those of
    torch.nn.utils.clip_grad_norm_ + torch.optim on the full gradients."""
    spawned, results = run(world)
    want = reference(case["name"])
    assert len(want["norms"]) == W.STEPS
    if case["max_norm"] < 1:  # the case clips: the norm is above max_norm
        assert all(float(n) > case["max_norm"] * 2 for n in want["norms"]), want["norms"]
    for rank in range(world):
        got = case_result(spawned, results, case["name"], rank)
        assert len(got["norms"]) == W.STEPS
        for k, (g, w) in enumerate(zip(got["norms"], want["norms"])):
            assert g.dtype == w.dtype and g.shape == w.shape == (), (k, g, w)
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"rank {rank} step {k}: {m}")
        assert_tensors_close(got["params"], want["params"], f"{case['name']} W={world} rank {rank}")


@pytest.mark.parametrize("case", WHOLE, ids=[c["name"] for c in WHOLE])
def test_whole_param_algorithms_through_zero(run, case):
    """Default partition is greedy; parameters and the consolidated state dict (torch's
    format: Adafactor's factored row_var/col_var) match torch.optim on one process."""
    spawned, results = run(2)
    want = reference(case["name"])
    for rank in range(2):
        got = case_result(spawned, results, case["name"], rank)
        assert got["partition"] == "greedy"
        # Muon orthogonalises in bfloat16: a last-bit difference of the averaged
        # gradient can move an update by one bfloat16 ulp (2^-8 relative) times lr
        tol = dict(rtol=1e-4, atol=1e-5) if case["algo"] == "Muon" else {}
        assert_tensors_close(got["params"], want["params"], f"{case['name']} rank {rank}", **tol)
    sd, want_sd = case_result(spawned, results, case["name"], 0)["state"], want["state"]
    spec = REGISTRY[case["algo"]]
    assert sd["state"].keys() == want_sd["state"].keys()
    for i, entry in want_sd["state"].items():
        assert list(sd["state"][i]) == list(entry), i
        for k, v in entry.items():
            got = sd["state"][i][k]
            if not isinstance(v, (torch.Tensor, list)):  # SOAP's per-parameter options, as the oracle keeps them
                assert got == v, (i, k, got, v)
                continue
            # SOAP's GG / Q: lists of matrices ([] for a dimension without one)
            assert isinstance(got, list) == isinstance(v, list) and len(state_tensors(got)) == len(state_tensors(v))
            for a, b in zip(state_tensors(got), state_tensors(v)):
                assert a.shape == b.shape, (i, k)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{i} {k}: {m}")
    assert [without_instance_keys(spec, {k: v for k, v in g.items() if k != "params"}, w)
            for g, w in zip(sd["param_groups"], want_sd["param_groups"])] == \
        [{k: v for k, v in g.items() if k != "params"} for g in want_sd["param_groups"]]
    # the torch.optim class loads what ZeRO consolidated
    model = W.Net()
    REGISTRY[case["algo"]].torch_cls(W.accepted(case["algo"], list(model.parameters())),
                                     **REGISTRY[case["algo"]].rich).load_state_dict(sd)


@pytest.mark.parametrize("case", REFUSE, ids=[c["name"] for c in REFUSE])
def test_flat_partition_refused(run, case):
    spawned, results = run(2)
    for rank in range(2):
        err = case_result(spawned, results, case["name"], rank)["error"]
        assert err is not None and "greedy" in err and case["algo"] in err, err


def test_every_whole_param_algorithm_is_covered():
    names = {c["algo"] for c in WHOLE}
    assert names == {n for n, s in REGISTRY.items() if s.whole_params}
    assert names >= {"Adafactor", "Muon", "SOAP"}

"""FSDP2 (``fully_shard``) and DDP with every registry algorithm, eager and scripted, on 2
gloo CPU ranks, checkpointed with torch.distributed.checkpoint (``get_state_dict`` /
``dcp.save`` / ``dcp.load`` / ``set_state_dict``); funcopt's ZeRO-1 stepped with
``step(closure)`` by position and by keyword, returning the closure's loss, and
checkpointed through the same DCP calls (``zero-dcp``).

The oracle is one single-process ``torch.optim`` run of the class of the same name on
the full batch: FSDP2 parameters (``full_tensor()``) and the full optimizer state
(``get_optimizer_state_dict(full_state_dict=True)``) must equal it (float32 rtol 1e-5),
and a run resumed from the DCP checkpoint must equal the uninterrupted run exactly.
An algorithm whose rule needs each parameter whole (``spec.whole_params``: Adafactor,
Muon) steps the gathered full parameters (torch.optim's own Adafactor raises on FSDP2
and its Muon rounds differently from a single process; funcopt's match the single
process).
One spawn runs every case (``_dist_fsdp2_work.py``).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_fsdp2_work as F  # noqa: E402
from _dist_harness import Net, assert_tensors_close, batch, case_result, load_all, spawn, state_tensors, tol  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: E402

from funcopt.registry import REGISTRY  # noqa: E402

SPAWN_DEADLINE = 420.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 60))
CASES = F.cases()
_RUN: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    if not _RUN:
        spawned = spawn(F.worker, 2, dist_tmp / "fsdp2", deadline=SPAWN_DEADLINE)
        _RUN["x"] = (spawned, load_all(spawned))
    return _RUN["x"]


@functools.lru_cache(maxsize=None)
def reference(algo: str):
    """torch.optim, one process, the full batch, TOTAL steps: params and full state dict."""
    spec = REGISTRY[algo]
    model = Net("small")
    opt = spec.torch_cls(F.trainable(spec, model.parameters()), **spec.rich)
    for step in range(F.TOTAL):
        x, y = batch(step, model)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return [p.detach().clone() for p in model.parameters()], osd


def test_spawn_clean(run):
    run[0].check()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_torch_optim_and_resumes_exactly(run, case):
    ref_params, ref_osd = reference(case["algo"])
    for rank in range(2):
        res = case_result(run[0], run[1], case["name"], rank)
        what = f"{case['name']} rank {rank}"
        assert_tensors_close(res["straight"], ref_params, f"{what}: params vs torch.optim", **tol(case["algo"]))
        if case["mode"] == "zero":
            for step, (got, seen) in enumerate(res["losses"]):
                assert len(seen) == 1 and isinstance(got, torch.Tensor) and torch.equal(got, seen[0]), \
                    f"{what}: step {step} returned {got}, its closure (called {len(seen)}x) returned {seen}"
            continue
        assert len(res["resumed"]) == len(res["straight"])
        for i, (a, b) in enumerate(zip(res["resumed"], res["straight"])):
            assert torch.equal(a, b), f"{what}: param {i} after the DCP resume differs from the uninterrupted run"
        got, want = res["osd"], ref_osd
        assert sorted(got["state"]) == sorted(want["state"]), f"{what}: state keys"
        for fqn, entry in want["state"].items():
            assert sorted(got["state"][fqn]) == sorted(entry), f"{what}: state[{fqn}] keys"
            for name, w in entry.items():
                g = got["state"][fqn][name]
                if not isinstance(w, (torch.Tensor, list)) and name != "step":  # SOAP's per-parameter options
                    assert g == w, f"{what}: {fqn}.{name}: {g} != {w}"
                    continue
                gs, ws = state_tensors(g, name), state_tensors(w, name)  # SOAP's GG / Q lists, an int step
                assert len(gs) == len(ws), f"{what}: {fqn}.{name}: {len(gs)} tensors, expected {len(ws)}"
                for a, b in zip(gs, ws):
                    if case["mode"] == "fsdp2" and b.dim() == 1 and a.dim() > 1 and a.numel() == b.numel():
                        a = a.reshape(-1)  # Prodigy's s, p0: FSDP2 shows them in the parameter's shape
                    torch.testing.assert_close(a, b.to(a.dtype) if b.dim() == 0 else b,
                                               **tol(case["algo"], 1e-5, 1e-7),
                                               msg=lambda m: f"{what}: {fqn}.{name}: {m}")
        assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]
        if case["mode"] == "fsdp2" and res["state_types"]:
            # per-element state is a DTensor like its parameter (torch.optim's format), so DCP shards it
            assert "DTensor" in res["state_types"], f"{what}: opt.state holds {res['state_types']}"

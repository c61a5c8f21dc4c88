"""The RPC DistributedOptimizer (trainer + one parameter server: world size 2) with
every registry algorithm that needs whole parameters (Adafactor, Muon), as the
torch.optim class and as the funcopt class, against torch.optim on one process
(see :mod:`_dist_rpc_whole_work`)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.rpc.is_available():
    pytest.skip("torch.distributed.rpc is not available", allow_module_level=True)

import _dist_rpc_whole_work as R  # noqa: E402

from funcopt.distributed.launch import launch  # noqa: E402

DEADLINE = 240.0
pytestmark = pytest.mark.timeout(int(DEADLINE + 60))
CASES = R.cases()
_JOB: dict = {}


@pytest.fixture(scope="module")
def job(dist_tmp):
    if "res" not in _JOB:
        _JOB["res"] = launch(R.role, 2, backend="rpc", rpc_name=R.name_of, timeout=30.0, deadline=DEADLINE,
                             grace=None, threads=1, workdir=dist_tmp / "rpc-whole", torchrun=False)
    return _JOB["res"]


def test_job_clean(job):
    assert not job.errors and all(c == 0 for c in job.exitcodes.values()), (job.errors, job.exitcodes)
    assert sorted(job.returns[0]) == sorted(c["name"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_local_torch_optim(job, case):
    got = job.returns[0][case["name"]]
    assert "__error__" not in got, got.get("__error__")
    want = R.reference(case)
    # Muon orthogonalises in bfloat16: dist_autograd sums the gradient in another
    # order, a last-bit difference can move an update by a bfloat16 ulp times lr
    tol = dict(rtol=1e-4, atol=1e-5) if case["algo"] == "Muon" else dict(rtol=1e-5, atol=1e-7)
    for i, (g, w) in enumerate(zip(got["params"], want["params"])):
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{case['name']} param {i}: {m}")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    # the optimizer moved what it owns, and only that
    init = R.init_params()
    owned = {id(t) for t in R.accepted(case["algo"], init)}
    for t, g in zip(init, got["params"]):
        assert (not torch.equal(t, g)) == (id(t) in owned)


def test_every_whole_param_algorithm_is_covered():
    from funcopt.registry import REGISTRY
    assert {c["algo"] for c in CASES} == {n for n, s in REGISTRY.items() if s.whole_params} >= {"Adafactor", "Muon"}

"""ReduceScatterBucketer at W=2 and 4: every callback gets the sum over ranks of its chunk.

One spawn per world size runs every scenario (``_dist_bucket_work.worker``);
the parent recomputes each expected sum from the known per-rank inputs.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_bucket_work as B  # noqa: E402
from _dist_harness import spawn  # noqa: E402

from funcopt.distributed import ReduceScatterBucketer  # noqa: E402

SPAWN_DEADLINE = 150.0
pytestmark = pytest.mark.timeout(int(SPAWN_DEADLINE + 60))
WORLDS = [2, 4]
_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(dist_tmp):
    def get(world):
        if world not in _RUNS:
            spawned = spawn(B.worker, world, dist_tmp / f"bucketer-w{world}", deadline=SPAWN_DEADLINE)
            spawned.check()
            _RUNS[world] = (spawned, {r: spawned.load(r) for r in range(world)})
        return _RUNS[world][1]
    return get


def _check_sums(got, world, rank, specs, first_call, members=None):
    assert sorted(got) == list(range(first_call, first_call + len(specs))), \
        f"rank {rank}: callbacks ran for calls {sorted(got)}"
    for k, (shape, dtype) in enumerate(specs, start=first_call):
        want = B.expected(world if members is None else len(members), rank, k, shape, dtype, members)
        out = got[k]
        assert out.shape == torch.Size(shape) and out.dtype == dtype, f"call {k}: {tuple(out.shape)} {out.dtype}"
        assert torch.equal(out, want), f"rank {rank} call {k} ({shape}, {dtype}): got {out}, expected {want}"


@pytest.mark.parametrize("world", WORLDS)
def test_small_and_large_inputs(run, world):
    specs = B.SMALL + [B.LARGE]
    large = len(specs) - 1
    for r, res in run(world).items():
        s = res["small"]
        # the large input went straight through (its callback ran inside the call), the small
        # ones waited in their buckets until flush()
        assert s["immediate"] == [large] and s["before_flush"] == [large], s
        dtypes = {d for _, d in B.SMALL}
        assert s["buckets_before"] == len(dtypes), "one bucket per dtype (device, group)"
        _check_sums(s["got"], world, r, specs, 0)
        assert s["buckets_after"] == 0, "flush() must release the bucket buffers"
        assert s["free_after_flush"] is None


@pytest.mark.parametrize("world", WORLDS)
def test_async_reduce_scatters_overlap_and_flush_completes_them(run, world):
    """Default max_in_flight=2: issued reduce-scatters keep running while the caller
    goes on (some callbacks are still pending before flush), never more than 2 are
    outstanding, and after flush() every callback has run with the right sum."""
    specs = B.FILL + [B.LARGE] * 4
    for r, res in run(world).items():
        a = res["async"]
        assert a["most_in_flight"] == 2, a["most_in_flight"]
        assert a["in_flight_before_flush"] > 0
        assert len(a["before_flush"]) < len(specs)
        _check_sums(a["got"], world, r, specs, 500)
        assert a["in_flight_after"] == 0 and a["free_after"] is None


@pytest.mark.parametrize("world", WORLDS)
def test_bucket_flushes_when_full(run, world):
    for r, res in run(world).items():
        f = res["fill"]
        assert 0 < len(f["before_flush"]) < len(B.FILL), \
            f"rank {r}: {len(f['before_flush'])} callbacks before flush(); the bucket should have filled and flushed"
        _check_sums(f["got"], world, r, B.FILL, 100)
        assert f["buckets_after"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_free_with_unflushed_data_raises(run, world):
    for r, res in run(world).items():
        f = res["free_unflushed"]
        assert f["error"] is not None and f["error"].startswith("RuntimeError") and "flush" in f["error"], f
        assert f["before_flush"] == []
        _check_sums(f["got"], world, r, B.SMALL[:3], 200)
        assert f["free_after"] is None and f["buckets_after"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_raise_value_error(run, world):
    for r, res in run(world).items():
        for what in ("wrong_count", "too_few", "mismatched_shapes", "mismatched_dtypes", "negative_size",
                     "negative_in_flight"):
            assert res[what] is not None and res[what].startswith("ValueError"), f"rank {r} {what}: {res[what]}"
        assert res["after_errors_buckets"] == 0, "a rejected input must not leave a bucket behind"


@pytest.mark.parametrize("world", WORLDS)
def test_bucket_size_zero_passes_everything_through(run, world):
    for r, res in run(world).items():
        n = res["nobucket"]
        assert n["immediate"] == list(range(300, 300 + len(B.SMALL))) and n["buckets"] == 0, n
        _check_sums(n["got"], world, r, B.SMALL, 300)


@pytest.mark.parametrize("world", WORLDS)
def test_no_callback(run, world):
    for res in run(world).values():
        assert res["no_callback_buckets"] == 0


def test_separate_groups_interleaved(run):
    """At W=4 calls on the world group and on a pair subgroup interleave; each goes to its own bucket."""
    specs = B.SMALL[:6]
    for r, res in run(4).items():
        g = res["groups"]
        assert g["before_flush"] == []
        assert g["buckets_before"] == 2 * len({d for _, d in specs})
        world_calls = {k: v for k, v in g["got"].items() if k < 450}
        pair_calls = {k: v for k, v in g["got"].items() if k >= 450}
        _check_sums(world_calls, 4, r, specs, 400)
        _check_sums(pair_calls, 2, r % 2, specs, 450)
        assert g["buckets_after"] == 0


def test_negative_bucket_size_single_process():
    with pytest.raises(ValueError):
        ReduceScatterBucketer(bucket_size_mb=-1)

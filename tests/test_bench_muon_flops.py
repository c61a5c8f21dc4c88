"""``funcopt bench step``'s FLOP limit for Muon (funcopt/bench/_step_limits.py): the
Newton-Schulz FLOP count, and the case figures that divide Muon's step by its
matmuls alone (the NS_FLOOR peer, timed in the same repeats)."""
import torch

from funcopt.bench._step_limits import NS_FLOOR, case_figures, ns_dims, ns_flops
from funcopt.bench._step_parts import ns_floor_peer


def test_ns_flops_formula():
    # X is m x n with m <= n whatever the orientation: per iteration X @ X^T, G @ G, G' @ X
    assert ns_dims((384, 128)) == ns_dims((128, 384)) == (128, 384)
    m, n = 128, 384
    assert ns_flops([(384, 128)], 5) == 5 * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)
    assert ns_flops([(7, 1), (1, 7)], 2) == 2 * 2 * (4 * 7 + 2)
    assert ns_flops([(3, 4), (5, 5)]) == ns_flops([(3, 4)]) + ns_flops([(5, 5)])


def test_floor_peer_runs_the_ns_matmuls():
    step, note = ns_floor_peer("Muon")([torch.zeros(6, 4), torch.zeros(3, 8)], [])
    step()
    assert "bfloat16" in note


def test_case_figures_divide_muon_by_its_floor():
    c = dict(algo="Muon", size="1M", threads=1, bytes_per_param=20.0, numel=1 << 20, impl="foreach",
             times_s={"funcopt script": [2.0, 3.0], NS_FLOOR: [1.0, 1.0], "torch.optim for-loop": [4.0, 4.0]},
             median_s={"funcopt script": 2.5, NS_FLOOR: 1.0, "torch.optim for-loop": 4.0})
    f = case_figures(c, 30.0)
    assert f["limit_s"] == 1.0 and f["limit_kind"] == "flop"
    assert f["x_limit"] == [2.0, 3.0]
    assert f["torch_best"] == "torch.optim for-loop"

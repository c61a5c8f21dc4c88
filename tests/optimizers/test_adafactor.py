"""Adafactor's column norm (``funcopt.optimizers.adafactor._col_norm``): the
same numbers as ``torch.norm(g, dim=-2, keepdim=True)`` -- which is what
``torch.optim.Adafactor`` calls -- bitwise, on the shapes of real models and of
the benchmark, with one and two intra-op threads, in every layout (the strided
ones take torch's own call); then whole steps on such shapes against
``torch.optim.Adafactor(foreach=True)`` (whose formula funcopt runs; the for-loop
differs from it in the last bit: ``add_(u, alpha=)`` is a fused multiply-add), bitwise.  ``tests/test_parity.py``
covers every hyperparameter on small shapes."""
import pytest
import torch

import funcopt
from funcopt.optimizers.adafactor import _col_norm

# the benchmark's matrices (16M: d=512; 64M: d=1024, the largest ones here are cut to
# keep the test short), odd sizes, a dimension of 1 or 2, 3-D and 4-D
SHAPES = [(7, 3), (3, 7), (2, 2), (2, 9), (9, 2), (1, 5), (5, 1), (2048, 512), (512, 2048), (1981, 512),
          (1024, 1024), (1, 4096), (4, 33000), (33000, 3), (300, 1), (2, 5, 7), (3, 1, 6), (3, 4, 1),
          (2, 3, 4, 5), (17, 64, 48)]


def _ref(g):
    return torch.norm(g, dim=-2, keepdim=True)


@pytest.fixture(params=[1, 2], ids=["1thr", "2thr"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_col_norm_bitwise(shape, threads):
    gen = torch.Generator().manual_seed(sum(shape))
    for scale in (1.0, 1e-3, 1e4):
        g = torch.randn(shape, generator=gen) * scale
        got, want = _col_norm(g), _ref(g)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want), (shape, scale, (got - want).abs().max())


def test_col_norm_other_layouts_and_dtypes():
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(64, 48, generator=gen).t(),  # transposed: torch reduces it as a last dim
             torch.randn(6, 40, 50, generator=gen)[:, ::2],  # strided rows
             torch.randn(2, 3, 8, 9, generator=gen).to(memory_format=torch.channels_last),
             torch.randn(40, 30, generator=gen, dtype=torch.float64),
             torch.randn(40, 30, generator=gen).to(torch.bfloat16),
             torch.zeros(5, 6), torch.full((4, 3), float("inf")), torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])]
    for g in cases:
        assert torch.equal(_col_norm(g), _ref(g)) or (_col_norm(g).isnan() == _ref(g).isnan()).all(), g.shape


def test_col_norm_scripts():
    f = torch.jit.script(_col_norm)
    g = torch.randn(70, 30)
    assert torch.equal(f(g), _ref(g))


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("big", [True, False], ids=["per-tensor", "foreach"])
@pytest.mark.parametrize("kw", [dict(lr=0.05, beta2_decay=-0.5, weight_decay=0.1),
                                dict(lr=0.01, eps=(1e-30, 1e-2), d=1.5, maximize=True)], ids=["decay", "maximize"])
def test_steps_match_torch_on_large_shapes(scripted, big, kw):
    # big: a tensor of >= 64K elements, so the step goes tensor by tensor (_adafactor_one)
    gen = torch.Generator().manual_seed(3)
    shapes = [(300, 250), (250, 300), (300,), (70000,), (6, 40, 50), (2, 1000), (1000, 2), (700, 1)]
    shapes = shapes if big else [s for s in shapes if s[0] * (s[1] if len(s) > 1 else 1) < 65536]
    base = [torch.randn(s, generator=gen) for s in shapes]
    fparams = [p.clone() for p in base]
    tparams = [p.clone().requires_grad_() for p in base]
    fo = funcopt.Adafactor(fparams, **kw)
    if scripted:
        fo = funcopt.script(fo)
    to = torch.optim.Adafactor(tparams, foreach=True, **kw)
    for _ in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        fo.step(grads)
        for p, g in zip(tparams, grads):
            p.grad = g
        to.step()
    for a, b in zip(fparams, tparams):
        assert torch.equal(a, b)
    for a, b in zip(fparams, tparams):
        for k in ("row_var", "col_var", "variance"):
            if k in to.state[b]:
                assert torch.equal(fo.state[a][k], to.state[b][k]), k


@pytest.mark.parametrize("maximize,weight_decay", [(False, 0.0), (True, 0.1)])
def test_single_formula_is_torch_for_loop_bitwise(maximize, weight_decay):
    """``adafactor_single`` (the kernel's per-tensor formula, the foreach step of one tensor
    with the for-loop's one-rounding update) gives ``torch.optim.Adafactor(foreach=False)``'s
    numbers bitwise, matrices and vectors, over several steps."""
    from funcopt.optimizers.adafactor import adafactor_single

    g0 = torch.Generator().manual_seed(3)
    shapes = [(6, 5), (7,), (2, 3, 4)]
    init = [torch.randn(s, generator=g0) for s in shapes]
    grads = [[torch.randn(s, generator=g0) for s in shapes] for _ in range(4)]
    tp = [p.clone() for p in init]
    topt = torch.optim.Adafactor(tp, lr=0.02, weight_decay=weight_decay, maximize=maximize, foreach=False)
    ps = [p.clone() for p in init]
    rows = [torch.zeros(s[:-1] + (1,)) if len(s) > 1 else torch.empty(0) for s in shapes]
    cols = [torch.zeros(s[:-2] + (1, s[-1])) if len(s) > 1 else torch.empty(0) for s in shapes]
    variances = [torch.zeros(s) if len(s) < 2 else torch.empty(0) for s in shapes]
    steps = [torch.tensor(0.0) for _ in shapes]
    for gs in grads:
        for p, g in zip(tp, gs):
            p.grad = g.clone()
        topt.step()
        for s in steps:
            s.add_(1)
        adafactor_single(ps, [g.clone() for g in gs], rows, cols, variances, steps, 0.02, -0.8, None, 1e-3,
                         1.0, weight_decay, maximize)
    for a, b in zip(ps, tp):
        assert torch.equal(a, b), (a - b).abs().max()

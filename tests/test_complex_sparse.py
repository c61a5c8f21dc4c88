"""Sparse COO gradients (SGD, Adagrad; refused by Adam/AdamW) and complex
parameters (every algorithm), against torch.optim as the oracle.

torch.optim's rules: SGD and Adagrad take sparse COO gradients
(``nn.Embedding(sparse=True)``); Adagrad refuses them with weight decay; Adam
and AdamW refuse them ("Adam does not support sparse gradients").  Complex
parameters are updated through ``torch.view_as_real`` views (Adam, Adagrad;
SGD's update is linear) and the state stays complex (torch's state_dict
format).  torch's fused kernels take neither: funcopt routes both through its
non-fused formulas on every path, so the default path works too.
"""
import pytest
import torch

import funcopt
from funcopt.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("single_thread")

IMPLS = {"auto": {}, "fused": dict(fused=True), "foreach": dict(foreach=True)}
MODES = ["eager", "scripted"]


def _sparse_grad(gen, rows, cols, step, dtype=torch.float32):
    """An uncoalesced COO gradient touching a few rows, one of them twice."""
    k = 4
    idx = torch.randint(0, rows, (k,), generator=gen)
    idx[-1] = idx[0]  # a duplicate index: the update must coalesce
    vals = torch.randn(k, cols, generator=gen, dtype=dtype)
    return torch.sparse_coo_tensor(idx.unsqueeze(0), vals, (rows, cols))


def _run_sparse(name, kw, impl, mode, steps=4):
    spec = REGISTRY[name]
    if impl == "fused" and "cpu" not in spec.fused_devices:
        pytest.skip(f"{name} has no fused CPU kernel in torch")
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(10, 3, generator=g), torch.randn(4, generator=g)]  # embedding table, dense bias
    fp = [p.clone().requires_grad_() for p in base]
    tp = [p.clone().requires_grad_() for p in base]
    opt = spec.cls(fp, **kw, **IMPLS[impl])
    if mode == "scripted":
        funcopt.script(opt)
    ref = spec.torch_cls(tp, **kw)  # torch's default (for-loop on CPU): its sparse path
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        grads = [_sparse_grad(gen, 10, 3, t), torch.randn(4, generator=gen)]
        opt.step(grads)
        for p, gr in zip(tp, grads):
            p.grad = gr
        ref.step()
    for a, b in zip(fp, tp):
        torch.testing.assert_close(a, b)
    fs, ts = opt.state_dict()["state"], ref.state_dict()["state"]
    assert fs.keys() == ts.keys()
    for i, entry in ts.items():
        assert fs[i].keys() == entry.keys()
        for k, v in entry.items():
            got = fs[i][k]
            assert got.layout == v.layout, (i, k, got.layout, v.layout)
            torch.testing.assert_close(got.to_dense(), v.to_dense(), msg=lambda m: f"{i} {k}: {m}")


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.3, maximize=True),
    dict(lr=0.1, momentum=0.9, nesterov=True),
]
ADAGRAD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-3),
    dict(lr=0.1, maximize=True),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sgd_sparse_gradients_like_torch(kw, impl, mode):
    _run_sparse("SGD", kw, impl, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kw", ADAGRAD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_adagrad_sparse_gradients_like_torch(kw, impl, mode):
    _run_sparse("Adagrad", kw, impl, mode)


def _snapshot(opt):
    sd = opt.state_dict()["state"]
    return ([p.detach().clone() for g in opt.param_groups for p in g["params"]],
            {i: {k: v.clone() for k, v in e.items()} for i, e in sd.items()})


def _assert_unchanged(before, opt):
    params, state = _snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(before[0], params)), "a parameter changed"
    assert state.keys() == before[1].keys()
    for i, e in before[1].items():
        for k, v in e.items():
            assert torch.equal(v, state[i][k]), (i, k)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_refuses_sparse_like_torch(name, impl, mode):
    spec = REGISTRY[name]
    p = torch.randn(10, 3, requires_grad=True)
    tp = p.detach().clone().requires_grad_()
    d = torch.randn(4, requires_grad=True)
    opt = spec.cls([d, p], lr=0.1, **IMPLS[impl])
    if mode == "scripted":
        funcopt.script(opt)
    opt.step([torch.ones(4), torch.ones(10, 3)])
    before = _snapshot(opt)
    gen = torch.Generator().manual_seed(0)
    ref = spec.torch_cls([tp], lr=0.1)
    tp.grad = _sparse_grad(gen, 10, 3, 0)
    with pytest.raises(RuntimeError) as torch_err:
        ref.step()
    for bad in (_sparse_grad(gen, 10, 3, 0), torch.randn(10, 3).to_sparse_csr()):
        with pytest.raises(RuntimeError, match="does not support sparse gradients"):
            opt.step([torch.ones(4), bad])
        _assert_unchanged(before, opt)
    assert "does not support sparse gradients" in str(torch_err.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,kw,pattern", [
    ("Adagrad", dict(weight_decay=0.1), "weight_decay option is not compatible with sparse gradients"),
    ("SGD", dict(weight_decay=0.1), "not compatible with sparse gradients"),
    ("SGD", dict(weight_decay=0.1, momentum=0.9), "not compatible with sparse gradients"),
])
def test_weight_decay_with_sparse_refused_like_torch(name, kw, pattern, mode):
    """torch.optim fails on these in the step (after bumping counters); we
    fail before any change."""
    spec = REGISTRY[name]
    gen = torch.Generator().manual_seed(0)
    tp = torch.randn(10, 3, requires_grad=True)
    ref = spec.torch_cls([tp], lr=0.1, **kw)
    tp.grad = _sparse_grad(gen, 10, 3, 0)
    with pytest.raises(RuntimeError):
        ref.step()
    p = torch.randn(10, 3, requires_grad=True)
    d = torch.randn(4, requires_grad=True)
    opt = spec.cls([d, p], lr=0.1, **kw)
    if mode == "scripted":
        funcopt.script(opt)
    opt.step([torch.ones(4), torch.ones(10, 3)])
    before = _snapshot(opt)
    with pytest.raises(RuntimeError, match=pattern):
        opt.step([torch.ones(4), _sparse_grad(gen, 10, 3, 0)])
    _assert_unchanged(before, opt)


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
def test_sparse_embedding_end_to_end(name):
    """``nn.Embedding(sparse=True)`` + a dense head, ``step()`` reading ``p.grad``."""
    spec = REGISTRY[name]
    kw = dict(lr=0.1, momentum=0.9) if name == "SGD" else dict(lr=0.1)
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1)))
    fo, to = spec.cls(models[0].parameters(), **kw), spec.torch_cls(models[1].parameters(), **kw)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, 20, (6,), generator=gen)
        for m, o in zip(models, (fo, to)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)


def test_sparse_with_grad_scale_and_found_inf():
    gen = torch.Generator().manual_seed(0)
    grads = [_sparse_grad(gen, 10, 3, t) for t in range(3)]
    for name in ("SGD", "Adagrad"):
        spec = REGISTRY[name]
        a, b = torch.randn(10, 3), None
        b = a.clone()
        oa = spec.cls([a.requires_grad_()], lr=0.1)
        ob = spec.cls([b.requires_grad_()], lr=0.1)
        for g in grads:
            oa.step([g * 4.0], grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
            ob.step([g])
            oa.step([g], found_inf=torch.tensor(float("nan")))  # skipped
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ complex
COMPLEX_KW = {name: spec.configs() for name, spec in REGISTRY.items()}
# rules whose complex handling is not their oracle's by decision (spec.cls.complex_differs_from_oracle:
# Prodigy and AdEMAMix refuse complex parameters, AdamWScheduleFree steps real views); their own
# test files test what they do instead
COMPLEX_LIKE_ORACLE = [n for n, s in REGISTRY.items() if not s.cls.complex_differs_from_oracle]


def _refused_like_torch(spec, kw, flags, mode, base, grads):
    """torch's class refuses these parameters (Adafactor, Muon: complex ones):
    funcopt refuses them too, with an error of the same type (at construction
    or in the step), and changes nothing."""
    tp = [p.clone().requires_grad_() for p in base]
    with pytest.raises(Exception) as torch_err:
        ref = spec.torch_cls(tp, **kw, **spec.torch_flags(flags))
        for p, gr in zip(tp, grads):
            p.grad = gr
        ref.step()
    fp = [p.clone().requires_grad_() for p in base]
    opt, before = None, None
    with pytest.raises(type(torch_err.value)):
        opt = spec.cls(fp, **kw, **spec.torch_flags(flags))
        if mode == "scripted":
            funcopt.script(opt)
        before = _snapshot(opt)
        opt.step(grads)
    if before is not None:
        _assert_unchanged(before, opt)
    for a, b in zip(fp, base):
        assert torch.equal(a.detach(), b), "a refused parameter changed"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=["c64", "c128"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["auto", "foreach"])
@pytest.mark.parametrize("name", COMPLEX_LIKE_ORACLE)
def test_complex_params_like_torch(name, impl, mode, dtype):
    spec = REGISTRY[name]
    real = torch.float32 if dtype == torch.complex64 else torch.float64
    for kw in COMPLEX_KW[name]:
        g = torch.Generator().manual_seed(0)
        # shapes as torch's class takes them (spec.param_shape: Muon matrices)
        base = [torch.randn(spec.param_shape(s), generator=g, dtype=dt)
                for s, dt in (((3, 4), dtype), ((5,), real), ((), dtype))]
        if not all(spec.takes(tuple(p.shape), p.dtype) for p in base):  # torch refuses complex
            gen = torch.Generator().manual_seed(1)
            grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in base]
            _refused_like_torch(spec, kw, IMPLS[impl], mode, base, grads)
            continue
        fp = [p.clone().requires_grad_() for p in base]
        tp = [p.clone().requires_grad_() for p in base]
        opt = spec.cls(fp, **kw, **spec.torch_flags(IMPLS[impl]))
        if mode == "scripted":
            funcopt.script(opt)
        refs = [spec.torch_cls(tp, **kw, **spec.torch_flags(dict(foreach=True)))]
        gen = torch.Generator().manual_seed(1)
        for t in range(4):
            grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in base]
            opt.step(grads)
            for p, gr in zip(tp, grads):
                p.grad = gr
            refs[0].step()
        for a, b in zip(fp, tp):
            torch.testing.assert_close(a, b, msg=lambda m: f"{kw}: {m}")
        fs, ts = opt.state_dict()["state"], refs[0].state_dict()["state"]
        for i, entry in ts.items():
            for k, v in entry.items():
                assert fs[i][k].dtype == v.dtype, (i, k)
                torch.testing.assert_close(fs[i][k], v, msg=lambda m: f"{kw} {i} {k}: {m}")


@pytest.mark.parametrize("name", COMPLEX_LIKE_ORACLE)
def test_complex_matches_torch_for_loop_too(name):
    """Against torch's single-tensor implementation (a second oracle)."""
    spec = REGISTRY[name]
    kw = COMPLEX_KW[name][0]
    g = torch.Generator().manual_seed(0)
    shape = spec.param_shape((6,))  # Muon: a matrix
    base = torch.randn(shape, generator=g, dtype=torch.complex128)
    if not spec.takes(shape, torch.complex128):  # torch refuses complex
        grads = [torch.randn(shape, generator=g, dtype=torch.complex128)]
        _refused_like_torch(spec, kw, dict(foreach=False), "eager", [base], grads)
        return
    fp, tp = base.clone().requires_grad_(), base.clone().requires_grad_()
    opt, ref = spec.cls([fp], **kw), spec.torch_cls([tp], **kw, **spec.torch_flags(dict(foreach=False)))
    for t in range(3):
        gr = torch.randn(shape, generator=g, dtype=torch.complex128)
        opt.step([gr])
        tp.grad = gr
        ref.step()
    torch.testing.assert_close(fp, tp)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_complex_fused_refused_like_torch(name):
    """torch: ``fused=True`` needs floating point parameters (an error at construction)."""
    spec = REGISTRY[name]
    if "cpu" not in spec.fused_devices:
        pytest.skip(f"{name} has no fused CPU kernel in torch")
    p = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    ref = spec.torch_cls([p], fused=True)
    p.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="fused"):  # torch: in the step
        ref.step()
    q = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    with pytest.raises((RuntimeError, ValueError), match="fused"):  # funcopt: at construction or in the step
        spec.cls([q], fused=True).step([torch.ones(2, dtype=torch.complex64)])
    assert not q.any()

"""SOAP against its oracle, ``pytorch_optimizer.SOAP``: funcopt runs the oracle's
ops in its order (the bases kept in the layout ``eigh``/QR give them), so
parameters, state and ``group['step']`` are bitwise equal -- eager and scripted,
float32 and float64, vectors, matrices, 3-D and 4-D tensors, 0-d and empty
parameters, with ``merge_dims`` (both data formats), ``precondition_1d``, basis
refreshes, ``None`` gradients and a group that has none for several steps.
Also: state dicts both ways (the oracle's lists and numbers), live state edits,
``torch.compile(fullgraph=True)`` (to rounding), non-contiguous parameters, and
what is refused where the oracle fails.  ``tests/test_parity.py`` runs the
registry's grid (without ``merge_dims``, which the oracle cannot run on the
vectors that test steps)."""
import copy
import math

import pytest
import torch

import funcopt

pytest.importorskip("pytorch_optimizer")
from pytorch_optimizer import SOAP as Oracle  # noqa: E402

STEPS = 25
BASE_SHAPES = [(10,), (7, 3), (2, 3, 4), (3, 2, 2, 5), ()]
# only without merge_dims (the oracle's merge_small_dims fails on them: see test_merge_refusal)
FLAT_ONLY = [(5,), (0,), (3, 0)]
CONFIGS = {
    "defaults": dict(),
    "1d-partial": dict(precondition_1d=True, precondition_frequency=3, max_precondition_dim=6, shampoo_beta=0.8),
    "merge": dict(merge_dims=True, max_precondition_dim=6, precondition_frequency=2),
    "options": dict(weight_decay=0.1, maximize=True, normalize_gradient=True, correct_bias=False,
                    betas=(0.9, 0.99), eps=1e-3, precondition_frequency=4),
    "merge-nhwc": dict(merge_dims=True, max_precondition_dim=6, data_format="channels_last", precondition_1d=True,
                       precondition_frequency=2, weight_decay=0.0),
    # one inductor compile (~60 s on 2 cores): merge-nhwc's shapes with options' switches
    "compiled": dict(merge_dims=True, max_precondition_dim=6, data_format="channels_last", precondition_1d=True,
                     precondition_frequency=2, weight_decay=0.1, maximize=True, normalize_gradient=True,
                     correct_bias=False, betas=(0.9, 0.99), eps=1e-3),
}


def _shapes(kw):
    return BASE_SHAPES + ([] if kw.get("merge_dims") else FLAT_ONLY)


def _groups(params, lr):
    """Two groups: the second (a larger lr) gets no gradient for the first three steps."""
    return [{"params": params[:-2]}, {"params": params[-2:], "lr": lr * 2}]


def _grads(shapes, dtype, gen, k):
    gs = [torch.randn(s, dtype=dtype, generator=gen) for s in shapes]
    if k in (0, 4):
        gs[0] = None  # its first gradient at the group's second step, then skipped again
    if k == 9:
        gs[2] = None
    if k < 3:
        gs[-1] = gs[-2] = None  # the second group: no gradient, its step counter still moves
    return gs


def _oracle_step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()  # the oracle negates p.grad in place (maximize)
    opt.step()


def _pair(kw, dtype, scripted=False, seed=0):
    kw = dict(dict(lr=0.01), **kw)
    shapes = _shapes(kw)
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, dtype=dtype, generator=g) for s in shapes]
    fp = [b.clone().requires_grad_() for b in base]
    tp = [b.clone().requires_grad_() for b in base]
    fo = funcopt.SOAP(_groups(fp, kw["lr"]), **kw)
    if scripted:
        funcopt.script(fo)
    to = Oracle(_groups(tp, kw["lr"]), **kw)
    return shapes, fp, tp, fo, to


def _same_value(a, b):
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _assert_same(fo, to, fp, tp):
    for a, b in zip(fp, tp):
        assert torch.equal(a, b), (a - b).abs().max()
    fs, ts = fo.state_dict(), to.state_dict()
    assert fs["param_groups"] == ts["param_groups"]  # data_format/maximize: the instance's, in both
    assert fs["state"].keys() == ts["state"].keys()
    for i, entry in ts["state"].items():
        assert list(fs["state"][i]) == list(entry), i
        for k, v in entry.items():
            assert _same_value(fs["state"][i][k], v), (i, k, fs["state"][i][k], v)


CASES = [(name, dt, False) for name in CONFIGS for dt in (torch.float32, torch.float64)]
CASES += [(name, torch.float64, True) for name in CONFIGS] + [("merge-nhwc", torch.float32, True)]


@pytest.mark.parametrize("name,dtype,scripted", CASES,
                         ids=[f"{n}-{str(d)[6:]}-{'scripted' if s else 'eager'}" for n, d, s in CASES])
def test_matches_oracle(name, dtype, scripted):
    shapes, fp, tp, fo, to = _pair(CONFIGS[name], dtype, scripted)
    start = [p.detach().clone() for p in fp]
    gen = torch.Generator().manual_seed(1)
    for k in range(STEPS):
        grads = _grads(shapes, dtype, gen, k)
        fo.step(grads)
        _oracle_step(to, tp, grads)
    _assert_same(fo, to, fp, tp)
    assert fo.param_groups[0]["step"] == STEPS and type(fo.param_groups[0]["step"]) is int
    assert all(not torch.equal(a, b) for a, b in zip(fp, start) if a.numel() > 0)


def _mlp_case(merge, precondition_1d, dtype, steps, freq):
    """An MLP-shaped set (matrices, their biases, a 4-D conv kernel, a 3-D tensor) on a
    regression loss; each side takes its own gradients.  Returns the largest
    relative parameter difference and the two loss curves."""
    g = torch.Generator().manual_seed(3)
    # biases of 17 and 13 > max_precondition_dim=12: with merge_dims a vector that fits in one merged
    # dimension fails in the oracle; the conv kernel's and the 3-D tensor's small dimensions merge
    shapes = [(17, 12), (17,), (13, 17), (13,), (6, 2, 3, 3), (2, 3, 8)]
    base = [torch.randn(s, dtype=dtype, generator=g) * 0.3 for s in shapes]
    x = torch.randn(32, 12, dtype=dtype, generator=g)
    y = torch.randn(32, 13, dtype=dtype, generator=g)
    img = torch.randn(4, 2, 5, 5, dtype=dtype, generator=g)

    def loss_fn(ps):
        w1, b1, w2, b2, conv, t3 = ps
        h = torch.tanh(x @ w1.t() + b1)
        out = h @ w2.t() + b2
        feat = torch.nn.functional.conv2d(img, conv).pow(2).mean()
        return ((out - y) ** 2).mean() + 0.1 * feat + 0.05 * (t3.sum(-1) ** 2).mean()

    kw = dict(lr=0.003, precondition_frequency=freq, merge_dims=merge, precondition_1d=precondition_1d,
              max_precondition_dim=12 if merge else 10000, weight_decay=0.01)
    fp = [b.clone().requires_grad_() for b in base]
    tp = [b.clone().requires_grad_() for b in base]
    fo, to = funcopt.SOAP(fp, **kw), Oracle(tp, **kw)
    fl, tl = [], []
    for _ in range(steps):
        for opt, ps, losses in ((fo, fp, fl), (to, tp, tl)):  # p.grad as backward leaves it (layouts too)
            opt.zero_grad()
            loss = loss_fn(ps)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(fp, tp))
    return rel, fl, tl


@pytest.mark.parametrize("merge", [False, True], ids=["flat", "merge"])
@pytest.mark.parametrize("precondition_1d", [False, True], ids=["no1d", "1d"])
def test_mlp_float64(merge, precondition_1d):
    rel, fl, tl = _mlp_case(merge, precondition_1d, torch.float64, 40, 5)
    assert rel == 0.0 and fl == tl, rel
    assert fl[-1] < fl[0]


@pytest.mark.rest
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("merge", [False, True], ids=["flat", "merge"])
@pytest.mark.parametrize("precondition_1d", [False, True], ids=["no1d", "1d"])
def test_mlp_long_run(merge, precondition_1d, dtype):
    """300 steps, a basis refresh every 10: parameters within 1e-12 (float64) / 1e-5
    (float32) of the oracle's, relative to their largest entry (bitwise here:
    the same ops), the losses alike."""
    rel, fl, tl = _mlp_case(merge, precondition_1d, dtype, 300, 10)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel <= tol, rel
    assert all(math.isclose(a, b, rel_tol=tol * 10, abs_tol=tol) for a, b in zip(fl, tl))
    assert fl[-1] < 0.5 * fl[0]


def test_state_dict_both_ways():
    """ours -> oracle and oracle -> ours after 7 steps (the oracle's groups have no
    data_format/maximize: ours take the constructor's), then 8 more steps of all
    four (and ours -> ours) on the same gradients: all equal."""
    kw = CONFIGS["merge-nhwc"]
    shapes, fp, tp, fo, to = _pair(kw, torch.float64)
    gen = torch.Generator().manual_seed(1)
    for k in range(7):
        grads = _grads(shapes, torch.float64, gen, k)
        fo.step(grads)
        _oracle_step(to, tp, grads)
    _assert_same(fo, to, fp, tp)
    kw = dict(dict(lr=0.01), **kw)
    fp2 = [p.detach().clone().requires_grad_() for p in tp]
    fo2 = funcopt.SOAP(_groups(fp2, kw["lr"]), **kw)
    fo2.load_state_dict(to.state_dict())
    tp2 = [p.detach().clone().requires_grad_() for p in fp]
    to2 = Oracle(_groups(tp2, kw["lr"]), **kw)
    to2.load_state_dict(copy.deepcopy(fo.state_dict()))  # torch's load keeps the very tensors otherwise
    fp3 = [p.detach().clone().requires_grad_() for p in fp]
    fo3 = funcopt.SOAP(_groups(fp3, kw["lr"]), **kw)
    fo3.load_state_dict(fo.state_dict())
    _assert_same(fo2, to, fp2, tp)
    _assert_same(fo, to2, fp, tp2)
    for k in range(7, 15):
        grads = _grads(shapes, torch.float64, gen, k)
        for opt in (fo, fo2, fo3):
            opt.step(grads)
        _oracle_step(to, tp, grads)
        _oracle_step(to2, tp2, grads)
    _assert_same(fo2, to, fp2, tp)
    _assert_same(fo, to2, fp, tp2)
    _assert_same(fo3, to, fp3, tp)


def test_state_dict_group_keys():
    """``data_format``/``maximize`` are the oracle's instance attributes: our state dict
    leaves them out where a group has the constructor's value (and ``step`` before
    the first step), keeps a group's own value (ours -> ours restores it)."""
    ps = [torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)]
    fo = funcopt.SOAP([{"params": ps[:1]}, {"params": ps[1:], "maximize": True}], lr=0.01)
    to = Oracle([{"params": [p.detach().clone().requires_grad_() for p in ps]}], lr=0.01)
    assert "step" not in fo.state_dict()["param_groups"][0]
    assert fo.state_dict()["param_groups"][0] == {**to.state_dict()["param_groups"][0], "params": [0]}
    fo.step([torch.ones(3, 4), torch.ones(4)])
    sd = fo.state_dict()
    assert "maximize" not in sd["param_groups"][0] and sd["param_groups"][1]["maximize"] is True
    assert sd["param_groups"][0]["step"] == 1 and "data_format" not in sd["param_groups"][1]
    again = funcopt.SOAP([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.01)
    again.load_state_dict(copy.deepcopy(sd))
    assert [g["maximize"] for g in again.param_groups] == [False, True]
    assert [g["data_format"] for g in again.param_groups] == ["channels_first"] * 2


def test_state_dict_refuses_bad_entries():
    p = torch.randn(4, 3, requires_grad=True)
    fo = funcopt.SOAP([p], lr=0.01)
    fo.step([torch.randn(4, 3)])
    good = fo.state_dict()
    bad_q = {**good["state"][0], "Q": [good["state"][0]["Q"][0]]}
    bad_gg = {**good["state"][0], "GG": [torch.zeros(3, 3), torch.zeros(3, 3)]}
    bad_freq = {**good["state"][0], "precondition_frequency": 0}
    for entry, msg in [(bad_q, "'GG' and 'Q' of parameter 0 have 2 and 1 entries"),
                       (bad_gg, r"GG\[0\] is 3 x 3, .* give that dimension 4"), (bad_freq, "positive integer")]:
        before = {k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v)
                  for k, v in fo.state[p].items()}
        with pytest.raises(ValueError, match=msg):
            fo.load_state_dict({"state": {0: entry}, "param_groups": good["param_groups"]})
        assert all(_same_value(fo.state[p][k], v) for k, v in before.items())


def test_live_state_edit():
    """Assigning a new ``Q`` list (and a number) in ``opt.state`` is seen by the next step, as in the oracle."""
    shapes, fp, tp, fo, to = _pair(CONFIGS["1d-partial"], torch.float64)
    gen = torch.Generator().manual_seed(1)
    for k in range(5):
        grads = _grads(shapes, torch.float64, gen, k)
        fo.step(grads)
        _oracle_step(to, tp, grads)
    for opt, p in ((fo, fp[2]), (to, tp[2])):
        q = opt.state[p]["Q"]
        opt.state[p]["Q"] = [torch.eye(q[0].shape[0], dtype=torch.float64), q[1], q[2]]
        opt.state[p]["precondition_frequency"] = 2
    for k in range(5, 12):
        grads = _grads(shapes, torch.float64, gen, k)
        fo.step(grads)
        _oracle_step(to, tp, grads)
    _assert_same(fo, to, fp, tp)


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("merge", [False, True], ids=["flat", "merge"])
def test_gradient_layouts(merge, scripted):
    """Transposed and permuted gradients: the oracle's moments take the first
    gradient's layout (``zeros_like(grad)``) and ``exp_avg_sq`` a refresh's result's,
    and the projections round by layout; funcopt follows (bitwise)."""
    kw = dict(lr=0.01, precondition_frequency=2, merge_dims=merge, max_precondition_dim=6)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, dtype=torch.float64, generator=g) for s in [(7, 5), (2, 3, 8), (4, 3, 2, 2)]]
    # dense layouts only: tests/_oracles.py hands the oracle clones of p.grad, and a clone of a
    # non-dense gradient (expanded, sliced) is contiguous
    fp = [b.clone().requires_grad_() for b in base]
    tp = [b.clone().requires_grad_() for b in base]
    fo, to = funcopt.SOAP(fp, **kw), Oracle(tp, **kw)
    if scripted:
        funcopt.script(fo)
    for _ in range(9):
        grads = [torch.randn(5, 7, dtype=torch.float64, generator=g).t(),
                 torch.randn(8, 2, 3, dtype=torch.float64, generator=g).permute(1, 2, 0),
                 torch.randn(4, 2, 2, 3, dtype=torch.float64, generator=g).permute(0, 3, 1, 2)]
        fo.step(grads)
        for p, gr in zip(tp, grads):
            p.grad = gr
        to.step()
    _assert_same(fo, to, fp, tp)
    assert fo.state[fp[0]]["exp_avg"].stride() == to.state[tp[0]]["exp_avg"].stride() == (1, 7)


def test_noncontiguous_parameters():
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(5, 4, dtype=torch.float64, generator=g).t(), torch.randn(6, 8, dtype=torch.float64,
                                                                                  generator=g)[:, ::2]]
    fp = [b.detach().clone(memory_format=torch.preserve_format).requires_grad_() for b in base]
    fp[1] = base[1].detach().clone().requires_grad_()
    tp = [p.detach().clone().requires_grad_() for p in fp]
    assert not fp[0].is_contiguous()
    kw = dict(lr=0.01, precondition_frequency=2)
    fo, to = funcopt.SOAP(fp, **kw), Oracle(tp, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen).t().contiguous().t() if p.dim() == 2 and
                 not p.is_contiguous() else torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in fp]
        fo.step(grads)
        _oracle_step(to, tp, grads)
    for a, b in zip(fp, tp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_merge_refusal():
    """A vector (or any parameter) whose elements all fit in one merged dimension: the
    oracle fails at its second step (``shape '[1]' is invalid``); funcopt at its
    first, before anything changes."""
    p = torch.randn(5, requires_grad=True)
    o = Oracle([p], merge_dims=True)
    p.grad = torch.ones(5)
    o.step()
    with pytest.raises(RuntimeError, match=r"shape '\[1\]' is invalid"):
        o.step()
    w = torch.randn(5, requires_grad=True)
    m = torch.randn(3, 4, requires_grad=True)
    before = [w.detach().clone(), m.detach().clone()]
    for scripted in (False, True):
        fo = funcopt.SOAP([m, w], merge_dims=True, max_precondition_dim=8)
        if scripted:
            funcopt.script(fo)
        with pytest.raises(ValueError, match=r"parameter 1 of shape torch.Size\(\[5\]\) cannot be merged"):
            fo.step([torch.ones(3, 4), torch.ones(5)])
        assert torch.equal(w, before[0]) and torch.equal(m, before[1]) and len(fo.state) == 0


@pytest.mark.parametrize("kw", [dict(lr=-0.1), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                                dict(shampoo_beta=-0.5), dict(weight_decay=-1.0), dict(precondition_frequency=0),
                                dict(max_precondition_dim=0), dict(eps=-1.0)], ids=str)
def test_ranges_in_the_oracles_words(kw):
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(Exception) as want:
        Oracle(p, **kw)
    with pytest.raises(ValueError) as got:
        funcopt.SOAP(p, **kw)
    assert str(got.value).startswith(str(want.value)), (str(got.value), str(want.value))


def test_refusals():
    with pytest.raises(RuntimeError, match="does not support complex parameter"):
        funcopt.SOAP([torch.zeros(2, dtype=torch.complex64, requires_grad=True)]).step(
            [torch.ones(2, dtype=torch.complex64)])
    with pytest.raises(RuntimeError, match="does not support sparse gradient"):
        funcopt.SOAP([torch.zeros(3, requires_grad=True)]).step([torch.ones(3).to_sparse()])
    with pytest.raises(ValueError, match="keeps at most 8"):
        funcopt.SOAP([torch.zeros([1] * 9, requires_grad=True)]).step([torch.ones([1] * 9)])
    with pytest.raises(ValueError, match="data_format='nchw' is not supported"):
        funcopt.SOAP([torch.zeros(3, requires_grad=True)], data_format="nchw")


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
def test_options_changed_after_state(scripted):
    """The oracle reads merge_dims, max_precondition_dim and precondition_1d afresh at
    every step: a factor they no longer give is kept (used, refreshed, not
    accumulated) -- funcopt too, bitwise; where they give a dimension a factor it
    does not have, or another preconditioned shape, the oracle fails mid-step
    (``[].lerp_``, a reshape) -- funcopt refuses before anything changes, and
    steps again once the options are back."""
    shapes = [(4, 6), (5,), (3, 2, 2)]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, dtype=torch.float64, generator=g) for s in shapes]
    fp = [b.clone().requires_grad_() for b in base]
    tp = [b.clone().requires_grad_() for b in base]
    kw = dict(lr=0.01, max_precondition_dim=5, precondition_frequency=2)  # (4, 6): no factor for 6
    fo, to = funcopt.SOAP(fp, **kw), Oracle(tp, **kw)
    if scripted:
        funcopt.script(fo)

    def step(n):
        for _ in range(n):
            grads = [torch.randn(s, dtype=torch.float64, generator=g) for s in shapes]
            fo.step(grads)
            _oracle_step(to, tp, grads)

    step(3)
    for opt in (fo, to):  # dimension 4 keeps its factor, no longer accumulated
        opt.param_groups[0]["max_precondition_dim"] = 3
    step(5)
    _assert_same(fo, to, fp, tp)
    for change, msg in [(dict(max_precondition_dim=8), r"parameter 0 .* dimension 1 has no factor"),
                        (dict(precondition_1d=True, max_precondition_dim=5),
                         r"parameter 1 .* dimension 0 has no factor"),
                        (dict(merge_dims=True, max_precondition_dim=4), r"parameter 2 .* preconditions 3 dimensions")]:
        before = [p.detach().clone() for p in fp]
        fo.param_groups[0].update(change)
        with pytest.raises(ValueError, match=msg):
            fo.step([torch.ones(s, dtype=torch.float64) for s in shapes])
        assert all(torch.equal(a, b) for a, b in zip(fp, before))
        fo.param_groups[0].update(max_precondition_dim=3, precondition_1d=False, merge_dims=False)
    step(2)
    _assert_same(fo, to, fp, tp)


def test_defaults_and_signature_are_the_oracles():
    import inspect

    ours = inspect.signature(funcopt.SOAP.__init__).parameters
    theirs = inspect.signature(Oracle.__init__).parameters
    for name, param in theirs.items():
        if name in ("self", "kwargs"):
            continue
        assert name in ours and ours[name].default == param.default, name
    assert list(ours)[:len(theirs) - 1] == [n for n in theirs if n != "kwargs"]


@pytest.mark.rest
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["compiled"])
def test_compile_fullgraph(name):
    """``torch.compile(fullgraph=True)`` (inductor): the step counter and the refresh
    test stay tensors (``torch.where``, ``torch.cond``), so no graph break; equal to
    eager to rounding.  (tests/test_compile.py runs the registry's rich configuration
    with aot_eager in the default tier.)"""
    torch._dynamo.reset()
    shapes, fp, tp, fo, _ = _pair(CONFIGS[name], torch.float32)
    pe = [p.detach().clone().requires_grad_() for p in fp]
    kw = dict(dict(lr=0.01), **CONFIGS[name])
    eager = funcopt.SOAP(_groups(pe, kw["lr"]), **kw)
    step = torch.compile(fo.step, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for k in range(7):
        grads = _grads(shapes, torch.float32, gen, k)
        eager.step(grads)
        step(grads)
    for a, b in zip(fp, pe):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sa, sb = eager.state_dict(), fo.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k in sa["state"][i]:
            torch.testing.assert_close(sb["state"][i][k], sa["state"][i][k], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()

"""Schedule-Free AdamW / SGD against their oracle, the ``schedulefree`` package's
``AdamWScheduleFree`` / ``SGDScheduleFree`` (foreach path, its default).

Every comparison drives both optimizers through the same script of
``train()``/``eval()`` calls and steps (train 5 steps, eval, train, 5 steps,
repeated calls, ...), with gradients that are sometimes ``None`` (one
parameter gets its first gradient late, after mode swaps), and compares the
parameters after every action and the whole ``state_dict`` (state and
param_groups, whose ``k``/``train_mode``/``weight_sum``/``lr_max``/
``scheduled_lr`` are the oracle's group state) at the end: bitwise in eager
float32/float64 and scripted, to rounding under ``torch.compile``.  The oracle
writes into ``p.grad`` (it divides it in place); funcopt must not write into
the gradients it is given, checked at every step.
"""
import copy
import itertools

import pytest
import torch

import funcopt

sf = pytest.importorskip("schedulefree")

NAMES = ["AdamWScheduleFree", "SGDScheduleFree"]
SHAPES = [(3, 4), (5,), (), (2, 1, 3)]
# train 5 steps, eval, train, 5 steps, eval twice (the second: nothing), train twice, ...
SCRIPT = ["train", 5, "eval", "train", 5, "eval", "eval", "train", "train", 4, "eval", "train", 8, "eval"]

CONFIGS = {
    "AdamWScheduleFree": [
        dict(),
        dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1, warmup_steps=5, r=1.0, weight_lr_power=0.0),
        dict(lr=0.02, eps=1e-3, warmup_steps=3, r=0.5, weight_lr_power=1.0, weight_decay=0.05),
        dict(lr=0.0),  # weight_sum stays 0: the averaging coefficient is 0 (the oracle's ZeroDivisionError)
    ],
    "SGDScheduleFree": [
        dict(lr=0.1),
        dict(lr=0.05, momentum=0.5, weight_decay=0.1, warmup_steps=5, r=1.0, weight_lr_power=0.0),
        dict(lr=0.2, momentum=0.95, warmup_steps=3, r=0.5, weight_lr_power=1.0),
        dict(lr=0.0, weight_decay=0.1),
    ],
}
# the rest tier: every combination
GRIDS = {
    "AdamWScheduleFree": dict(lr=[0.01], betas=[(0.9, 0.999), (0.5, 0.9)], eps=[1e-8, 1e-3], weight_decay=[0, 0.1],
                              warmup_steps=[0, 4], r=[0.0, 1.0], weight_lr_power=[2.0, 0.0]),
    "SGDScheduleFree": dict(lr=[0.1], momentum=[0.9, 0.5], weight_decay=[0, 0.1], warmup_steps=[0, 4],
                            r=[0.0, 1.0], weight_lr_power=[2, 0.0]),
}


def _grid(name):
    grid = GRIDS[name]
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def _make(name, kw, dtype=torch.float32, shapes=SHAPES, seed=0, layout=None, **ours_kw):
    """(oracle params, oracle, funcopt params, funcopt optimizer) from the same values."""
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    if layout is not None:
        base = layout(base)
    rp = [b.detach().clone().requires_grad_() if b.is_contiguous() else _like(b) for b in base]
    fp = [b.detach().clone().requires_grad_() if b.is_contiguous() else _like(b) for b in base]
    return rp, getattr(sf, name)(rp, **kw), fp, getattr(funcopt, name)(fp, **kw, **ours_kw)


def _like(b):
    """A leaf with ``b``'s values and strides (not contiguous)."""
    out = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype)
    out.copy_(b)
    return out.requires_grad_()


def _none_at(t, i):
    # parameter 3 gets its first gradient at step 7 (after mode swaps); others skip now and then
    return (i == 3 and t < 7) or (t + i) % 5 == 0


def _grads(params, t, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + t)
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        out.append(None if _none_at(t, i) else g)
    return out


def _same(rp, ref, fp, ours, exact=True):
    for i, (a, b) in enumerate(zip(rp, fp)):
        if exact:
            assert torch.equal(a.detach(), b.detach()), (i, (a - b).abs().max())
        else:
            torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)


def _same_state(ref, ours, exact=True):
    rs, fs = ref.state_dict(), ours.state_dict()
    if exact:
        assert rs["param_groups"] == fs["param_groups"]
    else:
        for rg, fg in zip(rs["param_groups"], fs["param_groups"]):
            assert rg.keys() == fg.keys()
            for k in rg:
                if isinstance(rg[k], float):
                    assert fg[k] == pytest.approx(rg[k], rel=1e-5, abs=1e-9), k
                else:
                    assert fg[k] == rg[k], k
    # the oracle's train()/eval() leave an empty entry (``'z' in self.state[p]`` of its
    # defaultdict) for a parameter that has had no gradient yet: no state either way
    rs["state"] = {i: v for i, v in rs["state"].items() if v}
    assert rs["state"].keys() == fs["state"].keys()
    for i in rs["state"]:
        assert list(rs["state"][i]) == list(fs["state"][i])
        for k, v in rs["state"][i].items():
            if exact:
                assert torch.equal(v, fs["state"][i][k]), (i, k)
            else:
                torch.testing.assert_close(fs["state"][i][k], v, rtol=1e-5, atol=1e-6)


def _drive(rp, ref, fp, ours, script=SCRIPT, exact=True, step=None, t0=0):
    """Both optimizers through ``script``; parameters compared after every action."""
    step = ours.step if step is None else step
    t = t0
    for action in script:
        if action == "train":
            ref.train()
            ours.train()
        elif action == "eval":
            ref.eval()
            ours.eval()
        else:
            for _ in range(action):
                gs = _grads(fp, t)
                for p, g in zip(rp, gs):
                    p.grad = None if g is None else g.clone()
                ref.step()
                kept = [None if g is None else g.clone() for g in gs]
                step(gs)
                for g, k in zip(gs, kept):  # funcopt never writes into the caller's gradients
                    assert (g is None and k is None) or torch.equal(g, k)
                t += 1
        _same(rp, ref, fp, ours, exact)
    return t


def _ids(configs):
    return [str(i) for i in range(len(configs))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("name,kw", [(n, c) for n in NAMES for c in CONFIGS[n]],
                         ids=[f"{n}-{i}" for n in NAMES for i in range(len(CONFIGS[n]))])
def test_parity_with_the_oracle(name, kw, scripted, dtype):
    rp, ref, fp, ours = _make(name, kw, dtype)
    if scripted:
        funcopt.script(ours)
    _drive(rp, ref, fp, ours)
    _same_state(ref, ours)
    assert ours.param_groups[0]["k"] == 22 and ours.param_groups[0]["train_mode"] is False


@pytest.mark.rest
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", NAMES)
def test_parity_with_the_oracle_whole_grid(name, dtype):
    for kw in _grid(name):
        for impl in ("auto", "foreach"):
            rp, ref, fp, ours = _make(name, kw, dtype, impl=impl)
            _drive(rp, ref, fp, ours)
            _same_state(ref, ours)


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_with_their_own_hyperparameters(name):
    """Two groups (different hyperparameters; the second without gradients for some
    steps: the oracle still counts its steps) and a group holding float32 and
    float64 parameters (two buckets; train()/eval() swap both)."""
    gen = torch.Generator().manual_seed(3)
    vals = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen, dtype=torch.float64),
            torch.randn(2, 2, generator=gen)]
    extra = dict(lr=0.05, weight_decay=0.1, warmup_steps=2) if name == "SGDScheduleFree" else \
        dict(lr=0.03, betas=(0.6, 0.95), weight_decay=0.1, warmup_steps=2)
    base = dict(lr=0.1) if name == "SGDScheduleFree" else dict(lr=0.01)

    def groups(ps):
        return [dict(params=ps[:2]), dict(params=ps[2:], **extra)]

    rp = [v.clone().requires_grad_() for v in vals]
    fp = [v.clone().requires_grad_() for v in vals]
    ref = getattr(sf, name)(groups(rp), **base)
    ours = getattr(funcopt, name)(groups(fp), **base)
    t = 0
    for action in ["train", 3, "eval", "train", 4, "eval", "train", 2, "eval"]:
        if action == "train":
            ref.train()
            ours.train()
        elif action == "eval":
            ref.eval()
            ours.eval()
        else:
            for _ in range(action):
                g = [torch.randn(v.shape, generator=gen, dtype=v.dtype) for v in vals]
                if 2 <= t <= 4:
                    g[2] = None  # the second group has no gradient
                for p, x in zip(rp, g):
                    p.grad = None if x is None else x.clone()
                ref.step()
                ours.step(g)
                t += 1
        _same(rp, ref, fp, ours)
    _same_state(ref, ours)
    assert [g["k"] for g in ours.param_groups] == [9, 9]


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_parameters(name):
    """Transposed and sliced parameters (and gradients of their strides)."""

    def layout(base):
        return [base[0].t(), base[1][::2], base[2], base[3].transpose(0, 2)]

    kw = CONFIGS[name][1]
    rp, ref, fp, ours = _make(name, kw, shapes=[(4, 3), (10,), (), (3, 1, 2)], layout=layout)
    assert not fp[0].is_contiguous() and not fp[1].is_contiguous()
    _drive(rp, ref, fp, ours)
    _same_state(ref, ours)


@pytest.mark.parametrize("name", NAMES)
def test_cache_blocked_formula(name, monkeypatch):
    """``foreach=False`` (the oracle's for-loop; funcopt's ``impl="auto"``): the
    foreach formula run cache-blocked, with blocks patched small so that the
    larger parameters are cut into chunks (each reads the whole group vector)."""
    from funcopt.optimizers import _core

    monkeypatch.setattr(_core, "BLOCK_BYTES", 2048)
    kw = dict(CONFIGS[name][1], foreach=False)
    rp, ref, fp, ours = _make(name, kw, shapes=[(40, 30), (700,), (3,), (2, 5)])
    assert ours.impl == "auto" and ours.core.block == 2048
    _drive(rp, ref, fp, ours)
    _same_state(ref, ours)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("direction", ["ours_to_oracle", "oracle_to_ours"])
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_with_the_oracle(name, direction, mode):
    """A checkpoint taken in train or eval mode, loaded into a fresh optimizer of
    the other kind, restores that mode; the loaded one and the one it came from
    then keep going (train()/eval() and steps) in step."""
    kw = CONFIGS[name][1]
    rp, ref, fp, ours = _make(name, kw)
    script = ["train", 9, "eval", "train", 3] + (["eval"] if mode == "eval" else [])
    t = _drive(rp, ref, fp, ours, script)
    values = [p.detach().clone() for p in fp]  # == rp's
    if direction == "ours_to_oracle":
        sd = copy.deepcopy(ours.state_dict())  # torch's load keeps the very tensors: copies
        rp = [v.clone().requires_grad_() for v in values]
        ref = getattr(sf, name)(rp, **kw)
        ref.load_state_dict(sd)
    else:
        sd = copy.deepcopy(ref.state_dict())
        fp = [v.clone().requires_grad_() for v in values]
        ours = getattr(funcopt, name)(fp, **kw)
        ours.load_state_dict(sd)
    assert [g["train_mode"] for g in sd["param_groups"]] == [mode == "train"]
    _same_state(ref, ours)
    assert ours.param_groups[0]["train_mode"] is (mode == "train")
    if mode == "eval":
        with pytest.raises(RuntimeError, match=r"train\(\)"):
            ours.step([torch.ones_like(p) for p in fp])
    _drive(rp, ref, fp, ours, ["eval", "train", 4, "eval", "train", 3, "eval"], t0=t)
    _same_state(ref, ours)


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("name", NAMES)
def test_step_in_eval_mode_raises_and_changes_nothing(name, scripted):
    p = torch.randn(3, 2, requires_grad=True)
    opt = getattr(funcopt, name)([p], lr=0.1)
    if scripted:
        funcopt.script(opt)
    grads = [torch.ones(3, 2)]
    assert opt.param_groups[0]["train_mode"] is True  # a fresh one is in train mode (the oracle's: eval)
    opt.eval()  # no state yet: nothing to swap, the mode recorded
    with pytest.raises(RuntimeError, match=r"in eval mode: call optimizer\.train\(\) before step\(\)"):
        opt.step(grads)
    assert not opt.state and opt.param_groups[0]["k"] == 0
    opt.train()
    opt.step(grads)
    opt.eval()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}, dict(opt.param_groups[0]))
    calls = []
    with pytest.raises(RuntimeError, match=r"train\(\)"):
        opt.step(lambda: calls.append(1))  # before the closure, as the oracle
    assert calls == []
    # the core's own check (the kernel's group(), before any tensor changes): what a
    # ScriptModule holding the core, or a distributed layer stepping it, runs into
    with pytest.raises((RuntimeError, torch.jit.Error), match=r"train\(\)"):
        opt.core.step(grads)
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
    assert opt.state_dict()["param_groups"][0] == {**before[2], "params": [0]}


@pytest.mark.parametrize("name", NAMES)
def test_train_and_eval_swap_only_parameters_with_state(name):
    """Before a parameter's first gradient there is no z: train()/eval() leave it
    alone (as the oracle), and every group's mode flips all the same."""
    kw = CONFIGS[name][0]
    rp, ref, fp, ours = _make(name, kw)
    _drive(rp, ref, fp, ours, ["train", 2, "eval", "train", "eval", "eval", "train", 1])
    assert not ours.state.get(fp[3]) and not ref.state.get(rp[3])
    _same_state(ref, ours)


@pytest.mark.parametrize("name", NAMES)
def test_amp_skipped_step_changes_nothing(name):
    p = torch.randn(4, requires_grad=True)
    opt = getattr(funcopt, name)([p], lr=0.1)
    opt.train()
    opt.step([torch.ones(4)])
    before = (p.detach().clone(), opt.state_dict())
    opt.step([torch.full((4,), float("inf"))], found_inf=torch.ones(()))
    assert torch.equal(p.detach(), before[0])
    after = opt.state_dict()
    assert after["param_groups"] == before[1]["param_groups"]
    assert all(torch.equal(after["state"][0][k], v) for k, v in before[1]["state"][0].items())


@pytest.mark.parametrize("name", NAMES)
def test_new_param_group_takes_the_current_mode(name):
    """add_param_group in train mode: the group starts in train mode (the oracle
    starts it in eval mode and its eval() then skips it); its parameters follow
    an oracle over that group alone, started when it was added."""
    kw = CONFIGS[name][1]
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(2, 2)
    rb = b.clone().requires_grad_()
    fb = b.clone().requires_grad_()
    ours = getattr(funcopt, name)([a], **kw)
    ours.train()
    ours.step([torch.ones(3)])
    ours.add_param_group(dict(params=[fb]))
    assert ours.param_groups[1]["train_mode"] is True
    ref = getattr(sf, name)([rb], **kw)
    ref.train()
    gen = torch.Generator().manual_seed(5)
    for t in range(4):
        g = torch.randn(2, 2, generator=gen)
        rb.grad = g.clone()
        ref.step()
        ours.step([torch.ones(3), g])
    ours.eval()
    ref.eval()
    assert torch.equal(fb.detach(), rb.detach())
    assert ours.param_groups[1]["train_mode"] is False and ours.param_groups[1]["k"] == 4


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.rest)])
@pytest.mark.parametrize("name", NAMES)
def test_compiled_step_matches_the_oracle(name, backend):
    """torch.compile(fullgraph=True) of a function that steps, with train()/eval()
    (eager) between compiled steps; a compiled step in eval mode raises.
    ``aot_eager`` traces through Dynamo and AOTAutograd (functionalization) as
    inductor does, without building C++ (inductor: the rest tier, ~30 s each)."""
    torch._dynamo.reset()
    try:
        kw = CONFIGS[name][2]
        rp, ref, fp, ours = _make(name, kw, shapes=[(8, 4), (5,), (3, 3), (2,)])

        @torch.compile(fullgraph=True, backend=backend)
        def step(grads):
            ours.step(grads)

        _drive(rp, ref, fp, ours, ["train", 3, "eval", "train", 5, "eval"], exact=False, step=step)
        _same_state(ref, ours, exact=False)
        before = [p.detach().clone() for p in fp]
        with pytest.raises(RuntimeError, match=r"train\(\)"):
            step([torch.ones_like(p) for p in fp])
        assert all(torch.equal(p.detach(), q) for p, q in zip(fp, before))
    finally:
        torch._dynamo.reset()


def test_defaults_and_signature_are_the_oracles():
    import inspect

    for name in NAMES:
        ours, oracle = getattr(funcopt, name), getattr(sf, name)
        p = torch.zeros(2, requires_grad=True)
        ref = oracle([p])
        ref.train()  # funcopt starts in train mode; the oracle after the train() its docs ask for
        # (its train() leaves an empty entry, which tests/_oracles.py leaves out: funcopt has none)
        assert ours([p]).state_dict() == ref.state_dict()
        mine = inspect.signature(ours.__init__).parameters
        theirs = inspect.signature(oracle.__init__).parameters
        positional = [k for k, v in mine.items() if v.kind != v.KEYWORD_ONLY]
        assert positional == list(theirs)
        assert all(mine[k].default == theirs[k].default for k in theirs if k not in ("self", "params"))
        assert [k for k, v in mine.items() if v.kind == v.KEYWORD_ONLY] == ["impl"]
        assert ours.torch_class == f"schedulefree:{name}"


@pytest.mark.parametrize("kw", [dict(lr=-0.1), dict(weight_decay=-1.0), dict(momentum=0.0), dict(momentum=1.0)])
def test_sgd_refuses_what_the_oracle_refuses(kw):
    with pytest.raises(ValueError) as theirs:
        sf.SGDScheduleFree([torch.zeros(2, requires_grad=True)], **kw)
    with pytest.raises(ValueError) as mine:
        funcopt.SGDScheduleFree([torch.zeros(2, requires_grad=True)], **kw)
    assert str(mine.value).startswith(str(theirs.value)) and "=" in str(mine.value)


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradients_are_refused(name):
    p = torch.zeros(3, requires_grad=True)
    opt = getattr(funcopt, name)([p])
    opt.train()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step([torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)])


@pytest.mark.parametrize("name", NAMES)
def test_complex_parameters_step_their_real_views(name):
    """A complex parameter is stepped as its real view (torch.optim's convention; the oracle's
    AdamW squares a complex gradient as a complex number): equal to stepping the real tensors."""
    g = torch.Generator().manual_seed(0)
    c = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    pc = c.clone().requires_grad_()
    pr = torch.view_as_real(c).clone().requires_grad_()
    oc, orr = getattr(funcopt, name)([pc], lr=0.05), getattr(funcopt, name)([pr], lr=0.05)
    for _ in range(5):
        gc = torch.randn(4, 3, dtype=torch.complex64, generator=g)
        oc.step([gc])
        orr.step([torch.view_as_real(gc).clone()])
    torch.testing.assert_close(torch.view_as_real(pc.detach()), pr.detach(), rtol=1e-6, atol=1e-7)
    oc.eval()
    orr.eval()
    torch.testing.assert_close(torch.view_as_real(pc.detach()), pr.detach(), rtol=1e-6, atol=1e-7)

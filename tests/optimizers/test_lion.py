"""Lion (not in torch.optim): the oracle ``LionReference`` (a per-tensor
``torch.optim.Optimizer`` written from the paper) against ``funcopt.Lion``
in float64 on a small least-squares problem, both against the paper's
formula written out here once more, and the decoupled decay's order (it
uses the parameter before the update, as in the paper)."""
import pytest
import torch

import funcopt
from funcopt.optimizers.lion import LionReference

STEPS = 25
CONFIGS = [
    dict(lr=0.01),
    dict(lr=0.01, weight_decay=0.3),
    dict(lr=0.02, betas=(0.5, 0.8), weight_decay=0.1, maximize=True),
    dict(lr=0.005, betas=(0.0, 0.0)),
]


def _problem():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 5, generator=g, dtype=torch.float64)
    b = torch.randn(8, generator=g, dtype=torch.float64)
    w = torch.randn(5, generator=g, dtype=torch.float64)
    c = torch.randn(3, 2, generator=g, dtype=torch.float64)
    return a, b, [w, c]


def _loss(a, b, params):
    w, c = params
    return ((a @ w - b) ** 2).mean() + (c ** 2).sum() * 0.5 + (c.sum() * w[:2].sum()) ** 2 * 0.1


def _run(make_opt, cfg, scripted=False):
    a, b, base = _problem()
    params = [p.clone().requires_grad_() for p in base]
    opt = make_opt(params, **cfg)
    if scripted:
        funcopt.script(opt)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(a, b, params)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return params, opt, losses


def _paper(cfg):
    """The paper's rule written out directly (float64), as an independent check of the oracle."""
    a, b, base = _problem()
    lr = cfg["lr"]
    beta1, beta2 = cfg.get("betas", (0.9, 0.99))
    wd = cfg.get("weight_decay", 0.0)
    sign = -1.0 if cfg.get("maximize", False) else 1.0
    params = [p.clone() for p in base]
    m = [torch.zeros_like(p) for p in params]
    for _ in range(STEPS):
        ps = [p.clone().requires_grad_() for p in params]
        grads = torch.autograd.grad(_loss(a, b, ps), ps)
        for i, g in enumerate(grads):
            g = sign * g
            update = torch.sign(beta1 * m[i] + (1 - beta1) * g)
            params[i] = params[i] - lr * (update + wd * params[i])
            m[i] = beta2 * m[i] + (1 - beta2) * g
    return params, m


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_reference_and_funcopt_agree_float64(cfg, scripted):
    ref_params, ref, ref_losses = _run(LionReference, cfg)
    fo_params, fo, fo_losses = _run(funcopt.Lion, cfg, scripted)
    for x, y in zip(ref_params, fo_params):
        assert x.dtype == torch.float64
        assert torch.equal(x, y), (x - y).abs().max()
    rs, fs = ref.state_dict()["state"], fo.state_dict()["state"]
    assert rs.keys() == fs.keys() == {0, 1}
    for i in rs:
        assert list(rs[i]) == list(fs[i]) == ["exp_avg"]
        assert torch.equal(rs[i]["exp_avg"], fs[i]["exp_avg"])
    assert ref.state_dict()["param_groups"] == fo.state_dict()["param_groups"]
    # the parameters moved, and (minimizing) the loss went down
    assert not torch.equal(fo_params[0], _problem()[2][0])
    if not cfg.get("maximize"):
        assert fo_losses[-1] < fo_losses[0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_reference_is_the_papers_formula(cfg):
    ref_params, ref, _ = _run(LionReference, cfg)
    paper_params, paper_m = _paper(cfg)
    for i, (x, y) in enumerate(zip(ref_params, paper_params)):
        torch.testing.assert_close(x.detach(), y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ref.state[ref_params[i]]["exp_avg"], paper_m[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make_opt", [LionReference, funcopt.Lion], ids=["reference", "funcopt"])
def test_decoupled_decay_uses_the_parameter_before_the_update(make_opt):
    """One step from m = 0: p1 = p0 - lr * (sign(g) + wd * p0).  Decaying after
    the update, (p0 - lr * sign(g)) * (1 - lr * wd), differs by lr^2 * wd * sign(g):
    0.02 here, far above rounding."""
    lr, wd = 0.2, 0.5
    p0 = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    g = torch.tensor([0.3, -0.7, -1.5, 2.0], dtype=torch.float64)
    p = p0.clone().requires_grad_()
    opt = make_opt([p], lr=lr, weight_decay=wd)
    p.grad = g.clone()
    opt.step()
    before = p0 - lr * (torch.sign(g) + wd * p0)
    after = (p0 - lr * torch.sign(g)) * (1 - lr * wd)
    torch.testing.assert_close(p.detach(), before, rtol=1e-15, atol=1e-15)
    assert (p.detach() - after).abs().min() > 0.01
    # and the momentum is updated after the sign is taken (m1 = (1 - beta2) g)
    torch.testing.assert_close(opt.state[p]["exp_avg"], (1 - 0.99) * g, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("kw,msg", [
    (dict(lr=-1e-3), "Invalid learning rate"),
    (dict(betas=(1.0, 0.99)), "Invalid beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value"),
])
def test_invalid_hyperparameters(kw, msg):
    for cls in (LionReference, funcopt.Lion):
        with pytest.raises(ValueError, match=msg):
            cls([torch.zeros(2, requires_grad=True)], **kw)


def test_defaults_are_the_papers():
    p = torch.zeros(2, requires_grad=True)
    for cls in (LionReference, funcopt.Lion):
        group = cls([p]).param_groups[0]
        assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)

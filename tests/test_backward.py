"""funcopt.step_in_backward: the step inside backward, bucket by bucket.

The oracle is the same funcopt optimizer stepped after backward
(``loss.backward(); opt.step()``): every registered algorithm (its ``base``
and ``rich`` configurations, fused and foreach, eager and scripted) must give
bitwise the same parameters and state over many steps, with an LR scheduler,
a hyperparameter change, frozen and unused parameters, gradient accumulation,
a parameter group added and a checkpoint loaded mid-training.
"""
import copy

import pytest
import torch
from torch import nn

import funcopt
from funcopt.registry import REGISTRY

STEPS = 6


class Net(nn.Module):
    """Layers of different sizes, a frozen layer and a branch used every other step."""

    def __init__(self, dtype=torch.float32, layers=4, width=16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(width, width, dtype=dtype) for _ in range(layers)])
        self.frozen = nn.Linear(width, width, dtype=dtype)
        self.frozen.requires_grad_(False)
        self.side = nn.Linear(width, 1, dtype=dtype)  # used on even steps only
        self.head = nn.Linear(width, 1, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.3)

    def forward(self, x, step=0):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        x = self.frozen(x)
        out = self.head(x)
        if step % 2 == 0:
            out = out + self.side(x)
        return out.pow(2).mean()


def _data(step, dtype, width=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, width, generator=g, dtype=dtype)


def _groups(spec, model, kw):
    """Two groups of the parameters the algorithm takes (matrix-only ones, e.g. Muon: 2-D)."""
    lo = dict(kw, lr=kw.get("lr", 0.01) * 0.5)
    ps = [p for p in model.parameters() if p.dim() >= len(spec.probe_shape)]
    half = len(ps) // 2
    return [{"params": ps[:half]}, dict(lo, params=ps[half:])]


def _build(name, kw, dtype, impl, scripted):
    spec = REGISTRY[name]
    model = Net(dtype)
    opt = spec.cls(_groups(spec, model, kw), **kw, **impl)
    if scripted:
        funcopt.script(opt)
    return model, opt


def _assert_same(m_ref, o_ref, m, o):
    for (n, a), b in zip(m_ref.named_parameters(), m.parameters()):
        assert torch.equal(a, b), n
    sr, s = o_ref.state_dict(), o.state_dict()
    assert sr["param_groups"] == s["param_groups"]
    assert set(sr["state"]) == set(s["state"])
    for i, entry in sr["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, s["state"][i][k]), (i, k)


def _impls(spec):
    out = [("foreach", dict(impl="foreach"))]
    if "cpu" in spec.fused_devices:
        out.append(("fused", dict(impl="fused")))
    return out


def _per_step_rules():
    """Rules with values that advance once per step (group_state: a group step counter, Prodigy's
    d): a step per bucket would advance them per bucket; step_in_backward refuses them."""
    return [name for name, spec in REGISTRY.items() if spec.cls.group_state or spec.cls.phases != 1]


def _cases():
    for name, spec in REGISTRY.items():
        if name in _per_step_rules():
            continue
        for cfg_name, kw in (("base", spec.base), ("rich", spec.rich)):
            for impl_name, impl in _impls(spec):
                for dtype in (torch.float32, torch.float64):
                    for scripted in (False, True):
                        if scripted and (cfg_name == "base" or dtype == torch.float64):
                            continue
                        yield pytest.param(name, dict(kw), dtype, impl, scripted,
                                           id=f"{name}-{cfg_name}-{impl_name}-{str(dtype)[6:]}"
                                              f"-{'scripted' if scripted else 'eager'}")


@pytest.mark.parametrize("name,kw,dtype,impl,scripted", list(_cases()))
def test_bitwise_equal_to_backward_then_step(name, kw, dtype, impl, scripted):
    m_ref, o_ref = _build(name, kw, dtype, impl, scripted)
    m, o = _build(name, kw, dtype, impl, scripted)
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=2, gamma=0.5)
    s = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
    handle = funcopt.step_in_backward(o, bucket_mb=1200 / 2 ** 20)  # several buckets
    assert len(handle.buckets) >= 3
    for step in range(STEPS):
        if step == 3:  # a hyperparameter change between steps
            for opt in (o_ref, o):
                opt.param_groups[1]["lr"] *= 3
        x = _data(step, dtype)
        m_ref(x, step).backward()
        o_ref.step()
        o_ref.zero_grad()
        m(x, step).backward()
        assert all(p.grad is None for g in o.param_groups for p in g["params"]), "gradients are freed"
        _assert_same(m_ref, o_ref, m, o)
        s_ref.step()
        s.step()
    assert handle.peak_grad_bytes > 0
    handle.remove()


def _adam():
    m_ref, o_ref = Net(), None
    m = copy.deepcopy(m_ref)
    o_ref = funcopt.Adam(m_ref.parameters(), lr=0.01)
    o = funcopt.Adam(m.parameters(), lr=0.01)
    return m_ref, o_ref, m, o


def test_step_after_backward_is_an_error_until_removed():
    m_ref, o_ref, m, o = _adam()
    handle = funcopt.step_in_backward(o, bucket_mb=0.001)
    m(_data(0, torch.float32)).backward()
    with pytest.raises(RuntimeError, match="already ran inside backward"):
        o.step()
    with pytest.raises(RuntimeError, match="already steps inside backward"):
        funcopt.step_in_backward(o)
    handle.remove()
    m(_data(1, torch.float32)).backward()
    assert all(p.grad is not None for p in m.layers.parameters())  # hooks gone
    o.step()  # allowed again


@pytest.mark.parametrize("name", _per_step_rules())
def test_refuses_rules_with_per_step_group_values(name):
    spec = REGISTRY[name]
    p = torch.zeros(spec.param_shape((4, 3)), requires_grad=True)
    opt = spec.cls([p], **spec.base)
    with pytest.raises(ValueError, match="once per step"):
        funcopt.step_in_backward(opt)
    assert getattr(opt, "_funcopt_in_backward", None) is None  # nothing installed
    for _ in range(2):  # and it still steps after backward (ADOPT's, SOAP's first step moves nothing)
        opt.step([torch.ones_like(p)])
    assert not torch.equal(p, torch.zeros_like(p))


def test_refuses_global_gradient_transforms():
    m_ref, o_ref, m, o = _adam()
    params = list(m.parameters())
    h = o.register_step_pre_hook(lambda opt, a, k: torch.nn.utils.clip_grad_norm_(params, 1.0))
    with pytest.raises(ValueError, match="step pre-hooks"):
        funcopt.step_in_backward(o)
    assert getattr(o, "_funcopt_in_backward", None) is None  # nothing installed
    h.remove()

    class ClippedAdam(funcopt.Adam):
        needs_all_grads = True

    with pytest.raises(ValueError, match="needs_all_grads"):
        funcopt.step_in_backward(ClippedAdam(params, lr=0.1))
    with pytest.raises(TypeError, match="funcopt optimizer"):
        funcopt.step_in_backward(torch.optim.Adam(params))
    with pytest.raises(ValueError, match="bucket_mb"):
        funcopt.step_in_backward(o, bucket_mb=0)
    # a pre-hook added after install is refused at the next backward, before any step
    handle = funcopt.step_in_backward(o, bucket_mb=0.001)
    before = [p.detach().clone() for p in params]
    h = o.register_step_pre_hook(lambda opt, a, k: None)
    with pytest.raises(ValueError, match="step pre-hooks"):
        m(_data(0, torch.float32)).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    h.remove()
    handle.remove()


def test_no_step_accumulates_like_backward_backward_step():
    m_ref, o_ref, m, o = _adam()
    handle = funcopt.step_in_backward(o, bucket_mb=0.001)
    for step in range(4):
        a, b = _data(2 * step, torch.float32), _data(2 * step + 1, torch.float32)
        m_ref(a, step).backward()
        m_ref(b, step).backward()
        o_ref.step()
        o_ref.zero_grad()
        with handle.no_step():
            m(a, step).backward()
        assert m.head.weight.grad is not None
        m(b, step).backward()
        _assert_same(m_ref, o_ref, m, o)
    handle.remove()


def test_param_group_added_and_checkpoint_loaded_mid_training():
    m_ref, o_ref, m, o = _adam()
    extra_ref = nn.Parameter(torch.ones(16))
    extra = nn.Parameter(torch.ones(16))
    handle = funcopt.step_in_backward(o, bucket_mb=0.001)
    for step in range(6):
        if step == 2:
            o_ref.add_param_group({"params": [extra_ref], "lr": 0.05})
            o.add_param_group({"params": [extra], "lr": 0.05})
        if step == 4:  # round trip through a checkpoint of each
            o_ref.load_state_dict(copy.deepcopy(o_ref.state_dict()))
            o.load_state_dict(copy.deepcopy(o.state_dict()))
        x = _data(step, torch.float32)
        (m_ref(x, step) + (extra_ref * x.mean()).sum() * (step >= 2)).backward()
        o_ref.step()
        o_ref.zero_grad()
        (m(x, step) + (extra * x.mean()).sum() * (step >= 2)).backward()
        _assert_same(m_ref, o_ref, m, o)
        assert torch.equal(extra_ref, extra)
    handle.remove()


def test_backward_that_raises_leaves_nothing_pending():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    torch.manual_seed(0)
    m_ref = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    m = copy.deepcopy(m_ref)
    o_ref = funcopt.Adam(m_ref.parameters(), lr=0.01)
    o = funcopt.Adam(m.parameters(), lr=0.01)
    handle = funcopt.step_in_backward(o, bucket_mb=1.0)  # one bucket: it cannot complete
    x = _data(0, torch.float32)
    with pytest.raises(RuntimeError, match="boom"):  # the head's gradients arrive, then it raises
        m[2](Boom.apply(m[1](m[0](x)))).pow(2).mean().backward()
    assert m[2].weight.grad is not None and m[0].weight.grad is None
    assert handle.held_grad_bytes > 0
    for p in m.parameters():
        p.grad = None
    for step in range(3):
        m_ref(_data(step, torch.float32)).pow(2).mean().backward()
        o_ref.step()
        o_ref.zero_grad()
        m(_data(step, torch.float32)).pow(2).mean().backward()
        for a, b in zip(m_ref.parameters(), m.parameters()):
            assert torch.equal(a, b)
        assert handle.held_grad_bytes == 0
    handle.remove()


def test_peak_gradient_memory_is_about_one_bucket():
    """12 layers: gradient bytes held during backward, counted by hooks of the
    test's own (they run before the step frees a bucket), stay within one
    bucket plus the largest parameter and under 1/4 of plain backward's."""
    width = 64
    model = Net(layers=12, width=width)
    params = [p for p in model.parameters() if p.requires_grad]
    seen = []

    def observe(_p):
        seen.append(sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None))

    for p in params:
        p.register_post_accumulate_grad_hook(observe)
    opt = funcopt.Adam(model.parameters(), lr=0.01)
    layer = (width * width + width) * 4
    handle = funcopt.step_in_backward(opt, bucket_mb=layer / 2 ** 20)
    x = _data(0, torch.float32, width)
    model(x).backward()
    total = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    peak = max(seen)
    assert peak <= handle.bucket_bytes + largest
    assert peak <= total / 4, (peak, total)
    assert handle.peak_grad_bytes == peak
    handle.remove()
    seen.clear()
    model(x).backward()  # plain backward holds every gradient at the end
    assert max(seen) == total

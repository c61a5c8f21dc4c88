"""Strided layouts: every path gives torch.optim's numbers for any layout.

torch's fused CPU kernels walk memory linearly, so a parameter, gradient or
state tensor that is not contiguous (channels_last conv weights, a transposed
matrix, an expanded gradient with stride 0, a slice of a larger tensor) used
to get wrong updates on the default (fused) path, and a process crash at about
1M elements.  Every algorithm x impl (auto = default, fused, foreach) x
eager/scripted is compared with torch.optim's foreach implementation (which
handles any layout) at its tolerance; the parameter must be updated in place
and keep its strides.
"""
import pytest
import torch

import funcopt
from _oracles import oracle_form
from funcopt.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("single_thread")

KW = {name: spec.rich for name, spec in REGISTRY.items()}
IMPLS = {"auto": {}, "fused": dict(fused=True), "foreach": dict(foreach=True)}
STEPS = 3


def _shapes(big):
    # (conv weight (O, I, k, k), matrix (a, b)) of ~1M or a few dozen elements
    return ((64, 64, 16, 16), (1024, 1024)) if big else ((4, 3, 3, 3), (5, 7))


def _layouts(big):
    """name -> (make_param(gen), make_grad(gen, step)); both deterministic."""
    conv, (a, b) = _shapes(big)
    cl = torch.channels_last

    def leaf(t):
        return t.detach().requires_grad_()

    return {
        "contiguous": (lambda g: leaf(torch.randn(a, b, generator=g)),
                       lambda g, t: torch.randn(a, b, generator=g)),
        "channels_last": (lambda g: leaf(torch.randn(conv, generator=g).to(memory_format=cl)),
                          lambda g, t: torch.randn(conv, generator=g).to(memory_format=cl)),
        # a channels_last parameter with a contiguous gradient (mixed strides)
        "channels_last-contig-grad": (lambda g: leaf(torch.randn(conv, generator=g).to(memory_format=cl)),
                                      lambda g, t: torch.randn(conv, generator=g)),
        "transposed": (lambda g: leaf(torch.randn(b, a, generator=g).t()),
                       lambda g, t: torch.randn(b, a, generator=g).t()),
        "transposed-contig-grad": (lambda g: leaf(torch.randn(b, a, generator=g).t()),
                                   lambda g, t: torch.randn(a, b, generator=g)),
        "expanded-grad": (lambda g: leaf(torch.randn(a, b, generator=g)),
                          lambda g, t: torch.randn(1, b, generator=g).expand(a, b)),
        "slice": (lambda g: leaf(torch.randn(a, 2 * b, generator=g)[:, 1:b + 1]),
                  lambda g, t: torch.randn(a, 2 * b, generator=g)[:, b:]),
        "zero-dim": (lambda g: leaf(torch.randn((), generator=g)),
                     lambda g, t: torch.randn((), generator=g)),
    }


def _build(layouts, names, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [layouts[n][0](g) for n in names]


def _grads(layouts, names, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [layouts[n][1](g, step) for n in names]


def _assert_refused_like_torch(spec, kw, param, grad):
    """torch's class refuses this parameter (Muon: a conv weight or a 0-d
    tensor): funcopt refuses it too, with an error of the same type, before
    changing it."""
    tp = param.detach().clone().requires_grad_()
    with pytest.raises(Exception) as torch_err:
        ref = spec.torch_cls([tp], **kw)
        tp.grad = grad.clone()
        ref.step()
    fp = param.detach().clone().requires_grad_()
    with pytest.raises(type(torch_err.value)):
        spec.cls([fp], **kw).step([grad.clone()])
    assert torch.equal(fp.detach(), param.detach()), "a refused parameter changed"


def _taken(spec, layouts, names):
    """The layouts whose parameter torch's class takes; each other one must be
    refused by funcopt as by torch (checked here)."""
    taken = []
    for n in names:
        g = torch.Generator().manual_seed(0)
        p, gr = layouts[n][0](g), layouts[n][1](g, 0)
        if spec.takes(tuple(p.shape), p.dtype):
            taken.append(n)
        else:
            _assert_refused_like_torch(spec, KW[spec.name], p, gr)
    return taken


def _check(name, impl, mode, names, big):
    spec = REGISTRY[name]
    if impl == "fused" and "cpu" not in spec.fused_devices:
        pytest.skip(f"{name} has no fused CPU kernel in torch")
    layouts = _layouts(big)
    names = _taken(spec, layouts, names)
    assert names, f"{name}: torch's class takes none of the layouts"
    fparams = _build(layouts, names)
    tparams = _build(layouts, names)
    strides = [p.stride() for p in fparams]
    ptrs = [p.data_ptr() for p in fparams]
    opt = spec.cls(fparams, **KW[name], **spec.torch_flags(IMPLS[impl]))
    if mode == "scripted":
        funcopt.script(opt)
    ref = spec.torch_cls(tparams, **KW[name], **spec.torch_flags(dict(foreach=True)))
    for t in range(STEPS):
        grads = _grads(layouts, names, t)
        opt.step(grads)
        for p, gr in zip(tparams, grads):
            p.grad = gr
        ref.step()
    for n, p, q, s, ptr in zip(names, fparams, tparams, strides, ptrs):
        assert p.stride() == s and p.data_ptr() == ptr, f"{n}: parameter not updated in place"
        torch.testing.assert_close(p, q, msg=lambda m: f"{name} {impl} {mode} {n}: {m}")
    fs, ts = opt.state_dict()["state"], ref.state_dict()["state"]
    for i, entry in ts.items():
        for k, v in entry.items():
            mine, v = oracle_form(fs[i][k], v)  # prodigyopt's int step, 0-d p0 (tests/_oracles.py)
            torch.testing.assert_close(mine, v, msg=lambda m: f"{name} {impl} {mode} {names[i]} {k}: {m}")


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_layout_small(name, impl, mode):
    """All layouts in one optimizer (one bucket: the fused kernel takes the
    contiguous ones, the rest go through the foreach formula)."""
    _check(name, impl, mode, list(_layouts(False)), big=False)


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("impl", ["auto", "foreach"])
# elementwise rules only: a whole-parameter rule (Muon's Newton-Schulz on 1024 x 1024
# matrices) costs minutes here and has no fused path to overrun; the small layouts cover it
@pytest.mark.parametrize("name", [n for n, s in REGISTRY.items() if not s.whole_params])
def test_every_layout_1m_elements(name, impl, mode):
    """~1M elements per tensor: the size at which the fused path read past
    the end of an expanded gradient (a segfault)."""
    names = ["channels_last", "transposed-contig-grad", "expanded-grad", "slice"]
    _check(name, impl, mode, names, big=True)


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_layout_change_after_construction(name, mode):
    """Strides may change after construction (``model.to(memory_format=...)``
    sets ``p.data``); the state keeps its old layout.  Checked per step."""
    spec = REGISTRY[name]
    shape = (4, 3, 3, 3)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g)
    if not spec.takes(shape):  # Muon: matrices only (channels_last needs 4-D)
        _assert_refused_like_torch(spec, KW[name], base, torch.randn(shape, generator=g))
        return
    fp, tp = base.clone().requires_grad_(), base.clone().requires_grad_()
    opt = spec.cls([fp], **KW[name])
    if mode == "scripted":
        funcopt.script(opt)
    ref = spec.torch_cls([tp], **KW[name], **spec.torch_flags(dict(foreach=True)))
    for t in range(4):
        if t == 2:  # contiguous state, channels_last parameter and gradients from now on
            for p in (fp, tp):
                p.data = p.data.to(memory_format=torch.channels_last)
        gr = torch.randn(shape, generator=g)
        if t >= 2:
            gr = gr.to(memory_format=torch.channels_last)
        opt.step([gr])
        tp.grad = gr
        ref.step()
        torch.testing.assert_close(fp, tp)
    assert fp.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_channels_last_state_follows_the_parameter(name):
    """State is allocated like torch's (``preserve_format``: parameter-shaped
    slots are channels_last; others, such as Adafactor's factored row/column
    state, have torch's strides) and the parameter stays channels_last, on the
    default path."""
    spec = REGISTRY[name]
    cl = torch.channels_last
    base = torch.randn(4, 3, 3, 3).to(memory_format=cl)
    grad = torch.randn(4, 3, 3, 3).to(memory_format=cl)
    if not spec.takes(tuple(base.shape)):  # Muon: matrices only
        _assert_refused_like_torch(spec, KW[name], base, grad)
        return
    p, tp = base.clone().requires_grad_(), base.clone().requires_grad_()
    opt = spec.cls([p], **KW[name])
    opt.step([grad])
    ref = spec.torch_cls([tp], **KW[name])
    tp.grad = grad
    ref.step()
    assert p.is_contiguous(memory_format=cl)
    torch_state = ref.state_dict()["state"][0]
    for k, v in opt.state_dict()["state"][0].items():
        if isinstance(v, torch.Tensor) and v.dim() == 4:
            if spec.cls.slot_shape(k, p) == tuple(p.shape):
                assert v.is_contiguous(memory_format=cl), k
            else:
                assert v.stride() == torch_state[k].stride(), (k, v.stride(), torch_state[k].stride())

"""CUDA paths (run by ``.ci/gpu`` on a machine with a GPU; skipped elsewhere).

* Every registry algorithm on CUDA parameters, eager and scripted, against
  ``torch.optim.<Name>`` on the same device: bitwise with torch's fused CUDA
  kernel where torch has one (Adam, AdamW, SGD, Adagrad: funcopt calls it),
  bitwise with torch's foreach otherwise (funcopt's native rules are CPU only;
  on CUDA the foreach formula runs).
* ``capturable=True`` where torch accepts it, same comparison.
* CUDA-graph capture of the scripted step of the fused algorithms (no host
  reads on that path): the replayed graph equals eager steps.

Written without a GPU at hand (the session that wrote it had none): see
docs/limits.md for what has and has not run on CUDA.
"""
from __future__ import annotations

import pytest
import torch

import funcopt
from funcopt.registry import REGISTRY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
STEPS = 10


def _params(spec, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (300,), (7, 3)]
    return [torch.randn(spec.param_shape(s), dtype=dtype, generator=g).cuda() for s in shapes]


def _flags(spec):
    return dict(fused=True) if "cuda" in spec.fused_devices else dict(foreach=True)


def _compare(name, kw, scripted, dtype=torch.float32):
    spec = REGISTRY[name]
    init = _params(spec, dtype)
    fp = [p.clone().requires_grad_() for p in init]
    tp = [p.clone().requires_grad_() for p in init]
    fo = spec.cls(fp, **spec.torch_flags(dict(kw, **_flags(spec))))
    if scripted:
        funcopt.script(fo)
    to = spec.torch_cls(tp, **spec.torch_flags(dict(kw, **_flags(spec))))
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        gs = [torch.randn(p.shape, dtype=dtype, generator=gen).cuda() for p in init]
        fo.step(gs)
        for p, g in zip(tp, gs):
            p.grad = g.clone()
        to.step()
    torch.cuda.synchronize()
    for a, b in zip(fp, tp):
        assert torch.equal(a, b), f"{name} {kw} scripted={scripted}"


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_cuda_matches_torch(name, scripted):
    _compare(name, REGISTRY[name].rich, scripted)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_cuda_capturable_matches_torch(name):
    spec = REGISTRY[name]
    kw = dict(spec.rich, capturable=True)
    try:
        spec.torch_cls([torch.zeros(spec.probe_shape, device="cuda", requires_grad=True)], **kw)
    except (TypeError, ValueError, RuntimeError) as e:
        pytest.skip(f"torch.optim.{name} refuses capturable=True: {e}")
    _compare(name, kw, scripted=False)


@pytest.mark.parametrize("name", [n for n, s in REGISTRY.items() if "cuda" in s.fused_devices])
def test_cuda_graph_capture_of_the_scripted_step(name):
    spec = REGISTRY[name]
    init = _params(spec)
    fp = [p.clone() for p in init]
    ep = [p.clone() for p in init]
    fo = funcopt.script(spec.cls(fp, **spec.rich, fused=True))
    eo = spec.cls(ep, **spec.rich, fused=True)
    grads = [torch.zeros_like(p) for p in init]
    gen = torch.Generator().manual_seed(2)
    # warm up on a side stream (state allocated), as CUDA graph capture requires
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=gen).cuda())
        fo.step(grads)
        eo.step([g.clone() for g in grads])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fo.step(grads)
    for _ in range(5):
        new = [torch.randn(g.shape, generator=gen).cuda() for g in grads]
        for g, n in zip(grads, new):
            g.copy_(n)
        graph.replay()
        eo.step(new)
    torch.cuda.synchronize()
    for a, b in zip(fp, ep):
        assert torch.equal(a, b), name

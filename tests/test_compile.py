"""``torch.compile(opt.step, fullgraph=True)`` on CPU, compared with eager.

Inductor builds C++ here (gcc), so each case takes tens of seconds.

* ``impl="foreach"``: compiles (the kernel's ``torch.compiler.is_compiling()``
  branch keeps the bias corrections on device, no ``.item()``).  Inductor
  fuses the foreach ops and computes the bias corrections in float32 tensors
  instead of host doubles, so results match eager to rounding, not bitwise.
* ``impl="fused"`` with ``amsgrad=True``: compiles and is bitwise equal (the
  ATen fused kernel runs in both).
* ``impl="auto"`` (= fused on CPU) with ``amsgrad=False``: in torch 2.13
  ``torch._fused_adam_`` with an empty ``max_exp_avg_sqs`` list breaks
  AOTAutograd functionalization ("mutating a non-functional tensor with a
  functional tensor is not allowed"); torch.optim avoids it with
  ``torch.compiler.disable``.  funcopt calls the out-of-place
  ``aten::_fused_adam`` under compile instead: same kernel, bitwise equal.
* SGD/Adagrad fused: no fake kernels in torch 2.13, so the foreach formula
  runs under compile.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

import funcopt

pytestmark = [
    pytest.mark.timeout(600),
    # inductor imports torch.utils.mkldnn, whose ScriptModules use
    # torch.jit.script_method: torch's own deprecation notice, nothing of ours
    pytest.mark.filterwarnings("ignore:`torch\\.jit\\.script_method` is deprecated:DeprecationWarning"),
]

SHAPES = [(8, 4), (5,), (3, 3)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every funcopt step goes through the same code object (torch.optim's
    # step wrapper), so recompiles of earlier tests would count against the
    # cache-size limit of later ones
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _params(seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _compare(impl: str, amsgrad: bool, exact: bool, n_steps: int = 3, eager_first: int = 0) -> None:
    """``eager_first`` steps of both optimizers run eagerly before compiling."""
    pe, pc = _params(), _params()
    eager = funcopt.Adam(pe, lr=0.01, amsgrad=amsgrad, impl=impl)
    compiled_opt = funcopt.Adam(pc, lr=0.01, amsgrad=amsgrad, impl=impl)
    g = torch.Generator().manual_seed(1)
    for _ in range(eager_first):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        eager.step(grads)
        compiled_opt.step(grads)
    step = torch.compile(compiled_opt.step, fullgraph=True)
    for _ in range(n_steps):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        eager.step(grads)
        step(grads)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    for a, b in zip(pe, pc):
        assert same(a, b), (a - b).abs().max()
    se, sc = eager.state_dict()["state"], compiled_opt.state_dict()["state"]
    assert se.keys() == sc.keys() == set(range(len(SHAPES)))
    for i in se:
        assert se[i].keys() == sc[i].keys()
        assert torch.equal(se[i]["step"], sc[i]["step"])
        for k in se[i]:
            assert same(se[i][k], sc[i][k]), (i, k)


def test_compile_adam_foreach():
    _compare("foreach", amsgrad=False, exact=False)


def test_compile_adam_fused_amsgrad():
    _compare("fused", amsgrad=True, exact=True)


def test_compile_adam_auto_fused():
    """Default impl (fused on CPU) without amsgrad: funcopt routes the compiled
    step through the out-of-place ``aten::_fused_adam`` (same kernel), so the
    result stays bitwise equal to eager."""
    _compare("auto", amsgrad=False, exact=True)


def test_compile_after_eager_steps():
    """Eager steps first (the step counters of the full bucket are then views of
    one tensor), then compiled ones: still bitwise equal to eager."""
    _compare("auto", amsgrad=False, exact=True, eager_first=2)


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9)), ("Adagrad", dict(lr=0.05))])
def test_compile_fused_without_fake_kernel_falls_back(name, kw):
    """torch 2.13 has no fake kernel for ``_fused_sgd_``/``_fused_adagrad_``;
    under torch.compile funcopt runs the foreach formula instead."""
    cls = getattr(funcopt, name)
    pe, pc = _params(), _params()
    eager, compiled_opt = cls(pe, impl="foreach", **kw), cls(pc, **kw)
    step = torch.compile(compiled_opt.step, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        eager.step(grads)
        step(grads)
    for a, b in zip(pe, pc):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


# ------------------------------------------------- every registered algorithm
def _registry_names():
    from funcopt.registry import REGISTRY

    return list(REGISTRY)


@pytest.mark.parametrize("name", _registry_names())
def test_every_algorithm_compiles_fullgraph(name):
    """``torch.compile(opt.step, fullgraph=True)`` for every registry entry
    (its ``rich`` configuration, foreach formula): no graph break, and the
    same numbers as eager to rounding.  ``aot_eager`` traces through Dynamo
    and AOTAutograd (functionalization) like inductor does, without building
    C++ (the Adam tests above cover inductor)."""
    from funcopt.registry import REGISTRY

    spec = REGISTRY[name]
    shapes = SHAPES if len(spec.probe_shape) != 2 else [(8, 4), (5, 2), (3, 3)]
    g0 = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g0) for s in shapes]
    pe = [p.clone().requires_grad_() for p in base]
    pc = [p.clone().requires_grad_() for p in base]
    kw = dict(spec.rich)
    eager, compiled_opt = spec.cls(pe, **kw), spec.cls(pc, **kw)
    step = torch.compile(compiled_opt.step, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in base]
        eager.step(grads)
        step(grads)
    for a, b in zip(pe, pc):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sa, sb = eager.state_dict()["state"], compiled_opt.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            torch.testing.assert_close(sa[i][k], sb[i][k], rtol=1e-5, atol=1e-6)

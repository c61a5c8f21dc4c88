"""Shared by the framework tests: one case per registry algorithm and flavour, the
tiny model and data, and the comparison with torch.optim (the oracle).

Every framework test runs the same training twice or more: once with the
``torch.optim`` class of the algorithm's name, once with funcopt's class (eager,
and scripted with ``funcopt.script`` where the framework allows), each built
from the registry's ``rich`` configuration, and compares the final parameters
(float32, rtol 1e-5).
"""
from __future__ import annotations

import importlib.util
import inspect
from typing import Any, Iterable, List, Sequence

import pytest
import torch
from torch import nn

import funcopt
from funcopt.registry import REGISTRY

RTOL, ATOL = 1e-5, 1e-6
FLAVOURS = ("torch", "eager", "scripted")


def need(*modules: str) -> None:
    """Skip the calling module, naming the framework that is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install 'funcopt[integrations]')",
                    allow_module_level=True)


def algorithm_cases(scripted: bool = True) -> List[Any]:
    """``pytest.param((name, flavour))`` for every registry algorithm: funcopt eager
    (and scripted) against torch.optim."""
    flavours = ("eager", "scripted") if scripted else ("eager",)
    return [pytest.param(name, f, id=f"{name}-{f}") for name in REGISTRY for f in flavours]


def trainable(spec: Any, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """The parameters the algorithm accepts: all, or only matrices for a rule defined on
    matrices (``probe_shape`` 2-D, e.g. Muon)."""
    params = list(params)
    if len(spec.probe_shape) >= 2:
        return [p for p in params if p.dim() == len(spec.probe_shape)]
    return params


def make_optimizer(name: str, flavour: str, params: Iterable[torch.Tensor], config: str = "rich",
                   **override: Any) -> torch.optim.Optimizer:
    """``flavour`` "torch": the torch.optim class (``foreach=True`` where it has that
    option); "eager"/"scripted": funcopt's, in its default implementation.  ``config``:
    the registry's "rich" or "base" hyperparameters."""
    spec = REGISTRY[name]
    kw = dict(getattr(spec, config), **override)
    params = trainable(spec, params)
    if flavour == "torch":
        # foreach: the op order funcopt's kernels follow (bitwise equal on plain tensors); on the
        # CPU torch's default is its per-tensor loop, which rounds differently in the last bits
        if "foreach" in inspect.signature(spec.torch_cls.__init__).parameters:
            kw.setdefault("foreach", True)
        return spec.torch_cls(params, **kw)
    opt = spec.cls(params, **kw)
    if flavour == "scripted":
        funcopt.script(opt)
    return opt


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def tiny_data(n: int = 32, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def snapshot(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    return [p.detach().clone() for p in params]


def assert_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str,
                 rtol: float = RTOL, atol: float = ATOL, algo: str = "") -> None:
    """Close within rtol/atol; for an algorithm funcopt steps with its native
    one-pass rule here, within torch's fused-vs-foreach tolerance at least
    (torch.testing's float32 defaults: the rule rounds sqrt correctly where
    torch's CPU sqrt is off by an ulp now and then)."""
    from funcopt import native
    from funcopt.registry import REGISTRY

    spec = REGISTRY.get(algo)
    if spec is not None and spec.native_rule and native.available():
        rtol, atol = max(rtol, 1.3e-6), max(atol, 1e-5)
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}[{i}]: {m}")


def assert_equal(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}[{i}]: max diff {(g.double() - w.double()).abs().max().item()}"


def assert_trained(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor], what: str) -> None:
    """The run changed the parameters (a comparison of two runs that did nothing proves nothing)."""
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), f"{what}: the parameters did not change"


def finite(params: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in params)

"""Shared test helpers: deterministic random parameters and gradients.

Grids: the registry-driven tests run every grid point of an algorithm where a
case is cheap and the pairwise cover ``spec.pairs()`` where it is expensive
(scripted, float64, for-loop parity); set ``FUNCOPT_FULL_GRID=1`` to run every
grid point everywhere (``funcopt/registry.py``, README "Run the tests").

The factories are session-scoped fixtures (plain functions), so hypothesis
tests may use them too.
"""
from typing import List, Optional, Sequence

import pytest
import torch

DEFAULT_SHAPES = ((3, 4), (5,), (), (2, 1, 3))


# the registry algorithm the running test is parametrized with ("name"), if
# any: make_params then shapes its tensors as that algorithm's torch class
# takes them (spec.param_shape: Muon matrices only, Adafactor no empty ones)
_CURRENT_SPEC: list = [None]


@pytest.fixture(autouse=True)
def _algorithm_under_test(request):
    from funcopt.registry import REGISTRY

    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("name") if callspec is not None else None
    _CURRENT_SPEC[0] = REGISTRY.get(name) if isinstance(name, str) else None
    yield
    _CURRENT_SPEC[0] = None


def _params(shapes: Sequence = DEFAULT_SHAPES, dtype: torch.dtype = torch.float32, seed: int = 0) -> List[torch.Tensor]:
    """Leaf tensors with ``requires_grad``; the same seed gives the same values."""
    gen = torch.Generator().manual_seed(seed)
    spec = _CURRENT_SPEC[0]
    if spec is not None:
        shapes = [spec.param_shape(tuple(s)) for s in shapes]
    return [torch.randn(tuple(s), generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _grads(params: Sequence[torch.Tensor], step: int, seed: int = 1) -> List[Optional[torch.Tensor]]:
    """One fresh gradient per parameter, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _clone(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


@pytest.fixture(scope="session")
def make_params():
    return _params


@pytest.fixture(scope="session")
def make_grads():
    return _grads


@pytest.fixture(scope="session")
def clone_params():
    return _clone


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests: on a shared
    2-core machine, waking torch's thread pool for a 12-element fused kernel
    can cost milliseconds.  Results do not depend on it (elementwise ops)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    """One intra-op thread for the whole suite: the tests use tiny tensors, for
    which waking torch's thread pool costs more than the work (milliseconds per
    fused step on a busy 2-core machine).  Results do not depend on it."""
    torch.set_num_threads(1)


# FUNCOPT_EXTRA_ALGORITHMS: paths of algorithm files (a formula file that ends
# with its one ``registry.register(...)`` call) to load before collection, so
# the registry-driven tests run over them too (tests/test_extending.py).
def _load_extra_algorithms() -> None:
    import importlib.util
    import os

    for path in filter(None, os.environ.get("FUNCOPT_EXTRA_ALGORITHMS", "").split(os.pathsep)):
        name = "funcopt_extra_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        import sys

        sys.modules[name] = module  # TorchScript finds the kernel's source through its module
        spec.loader.exec_module(module)


_load_extra_algorithms()

"""The algorithm registry: one entry per algorithm.

Tests (parity, contracts), the docs tables, the benchmarks and the
distributed layers iterate over ``REGISTRY``; adding an algorithm is one file
in ``optimizers/`` (its kernel and thin class, see ``optimizers/_core.py``)
plus one ``AlgorithmSpec`` line here.  ``funcopt`` exports every registered
class at the top level.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Type, Union

import torch

from .base import Optimizer


@dataclass(frozen=True)
class AlgorithmSpec:
    """What the rest of funcopt needs to know about one algorithm.

    Attributes:
      name: the ``torch.optim`` class name (funcopt's class has the same name).
      cls: the funcopt optimizer class, or the name of its module in
        ``funcopt.optimizers`` (the class is that module's attribute ``name``).
      grid: hyperparameter values for the parity tests; every combination
        torch accepts is tested (invalid ones are skipped by asking torch).
      base: hyperparameters applied to every grid point (e.g. a larger lr).
      rich: one configuration with most options on, for the tests that run a
        single configuration per algorithm (layouts, AMP, complex, ZeRO, RPC);
        defaults to ``base``.

    The oracle is ``cls.torch_class``: the ``torch.optim`` class, or for an
    algorithm torch lacks (Lion) a plain per-tensor ``torch.optim.Optimizer``
    written from the paper, shipped next to the kernel.
    """

    name: str
    cls: Union[Type[Optimizer], str]
    grid: Dict[str, List[Any]] = field(default_factory=dict)
    base: Dict[str, Any] = field(default_factory=dict)
    rich: Optional[Dict[str, Any]] = None

    def __post_init__(self) -> None:
        if isinstance(self.cls, str):
            module = importlib.import_module(f"{__package__}.optimizers.{self.cls}")
            object.__setattr__(self, "cls", getattr(module, self.name))
        if self.rich is None:
            object.__setattr__(self, "rich", dict(self.base))

    def takes(self, shape: tuple, dtype: torch.dtype = torch.float32) -> bool:
        """Whether ``torch_cls`` steps a parameter of this shape and dtype (asked
        once, on a throw-away tensor): Muon takes matrices only, Adafactor no
        empty tensors, neither complex ones.  Tests build their parameters with
        :meth:`param_shape` and skip what torch itself refuses."""
        return _takes(self.torch_cls, tuple(shape), dtype, tuple(sorted(self.base.items())))

    def param_shape(self, shape: tuple) -> tuple:
        """``shape`` if ``torch_cls`` takes it, else the nearest shape it takes
        (same leading size: a vector (n,) becomes (n, 1) for a matrices-only rule,
        (2, 1, 3) becomes (2, 3), an empty or 0-d one (1,) or (1, 1))."""
        shape = tuple(shape)
        if self.takes(shape):
            return shape
        n = 1
        for d in shape:
            n *= d
        lead = shape[0] if shape and shape[0] > 0 else 1
        rest = max(1, n // lead) if n > 0 else 1
        for cand in ((max(n, 1),), (lead, rest), (1, 1)):
            if self.takes(cand):
                return cand
        raise ValueError(f"{self.name}: no parameter shape near {shape} that torch.optim.{self.name} takes")

    def torch_flags(self, flags: Dict[str, Any]) -> Dict[str, Any]:
        """``flags`` (``foreach=``/``fused=``...) without those ``torch_cls`` has no
        argument for (Muon: one implementation only)."""
        import inspect as _inspect

        accepted = _inspect.signature(self.torch_cls.__init__).parameters
        return {k: v for k, v in flags.items() if k in accepted}

    def configs(self) -> List[Dict[str, Any]]:
        """``rich``, plus ``rich`` with ``maximize=True`` where torch accepts it:
        the configurations single-configuration tests run."""
        out = [dict(self.rich)]
        try:
            self.torch_cls([torch.zeros(self.probe_shape, requires_grad=True)], **dict(self.rich, maximize=True))
            out.append(dict(self.rich, maximize=True))
        except (TypeError, ValueError, RuntimeError):
            pass
        return out

    @property
    def probe_shape(self) -> tuple:
        """A parameter shape torch's class accepts (Muon: 2-D only)."""
        return tuple(getattr(self.cls, "probe_shape", (1,)))

    @property
    def whole_params(self) -> bool:
        """The rule needs each parameter whole (ZeRO places parameters, never cuts them)."""
        return bool(getattr(self.cls, "whole_params", False))

    @property
    def native_rule(self) -> Optional[str]:
        """The name of the algorithm's native one-pass rule (``funcopt/optimizers/<name>.cpp``,
        :mod:`funcopt.native`), or None (an ATen fused kernel or a whole-parameter rule)."""
        rule = getattr(self.cls, "native_rule", None)
        return None if rule is None else rule[0]

    @property
    def torch_cls(self) -> type:
        """The oracle class: ``cls.torch_class``, imported here where it is a
        ``"module:Class"`` string (an algorithm torch.optim lacks: its reference
        package, a test-only dependency -- ``pip install funcopt[test]``)."""
        return resolve_oracle(self.cls.torch_class, self.name)

    @property
    def oracle_package(self) -> Optional[str]:
        """The package of an oracle outside torch (``"schedulefree"``...), else None."""
        oracle = self.cls.torch_class
        return oracle.split(":", 1)[0].split(".", 1)[0] if isinstance(oracle, str) else None

    @property
    def fused_devices(self) -> tuple:
        return self.cls.fused_devices

    def combos(self) -> Iterator[Dict[str, Any]]:
        """Every grid point that torch.optim accepts, merged over ``base``."""
        for _, kw in self._points():
            yield kw

    def _points(self) -> Iterator[tuple]:
        """``(value indices, kwargs)`` of every grid point torch.optim accepts."""
        keys = list(self.grid)
        for idx in itertools.product(*(range(len(self.grid[k])) for k in keys)):
            kw = dict(self.base, **{k: self.grid[k][i] for k, i in zip(keys, idx)})
            try:
                self.torch_cls([torch.zeros(self.probe_shape, requires_grad=True)], **kw)
            except (ValueError, RuntimeError):
                continue
            yield idx, kw

    def pairs(self) -> List[Dict[str, Any]]:
        """A pairwise (all-pairs) covering subset of :meth:`combos`, in grid order.

        Every value of every option, and every pair of values of two options
        that appears together in some accepted grid point, appears together
        in at least one returned point.  Deterministic: greedily take the
        first accepted point covering the most pairs not yet covered, until
        none is left.  The expensive test dimensions (scripted steps, float64
        for-loop parity, state-dict round trips) run over these; the cheap
        ones over :meth:`combos`.  With the environment variable
        ``FUNCOPT_FULL_GRID=1`` this returns every point of :meth:`combos`.

        Example::

            >>> from funcopt.registry import REGISTRY
            >>> spec = REGISTRY["Muon"]
            >>> len(spec.pairs()) < len(list(spec.combos()))
            True
        """
        points = list(self._points())
        if os.environ.get("FUNCOPT_FULL_GRID", "") not in ("", "0"):
            return [kw for _, kw in points]
        return [points[i][1] for i in sorted(_pairwise_cover([idx for idx, _ in points]))]


def _pairwise_cover(rows: List[tuple]) -> List[int]:
    """Indices of a subset of ``rows`` (tuples of value indices) holding every
    (column, value) and every pair of (column, value)s that some row holds."""

    def pairs_of(row: tuple) -> set:
        cells = list(enumerate(row))
        return {(a, b) for i, a in enumerate(cells) for b in cells[i:]}  # i == j: the single values

    covers = [pairs_of(r) for r in rows]
    todo = set().union(*covers) if covers else set()
    chosen: List[int] = []
    while todo:
        best = max(range(len(rows)), key=lambda i: (len(covers[i] & todo), -i))
        chosen.append(best)
        todo -= covers[best]
    return chosen


_SPECS = [
    AlgorithmSpec("SGD", "sgd", base=dict(lr=0.05), grid=dict(
        momentum=[0.0, 0.9], dampening=[0.0, 0.3], nesterov=[False, True],
        weight_decay=[0.0, 0.1], maximize=[False, True]),
        rich=dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True)),
    AlgorithmSpec("Adam", "adam", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.999), (0.5, 0.9)], weight_decay=[0.0, 0.1], amsgrad=[False, True],
        maximize=[False, True], decoupled_weight_decay=[False, True]),
        rich=dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    AlgorithmSpec("AdamW", "adamw", base=dict(lr=0.01), grid=dict(
        weight_decay=[0.0, 0.1], amsgrad=[False, True], maximize=[False, True], eps=[1e-8, 1e-3]),
        rich=dict(lr=0.01, amsgrad=True)),
    AlgorithmSpec("Adagrad", "adagrad", base=dict(lr=0.05), grid=dict(
        lr_decay=[0.0, 0.01], weight_decay=[0.0, 0.1], initial_accumulator_value=[0.0, 0.1],
        maximize=[False, True], eps=[1e-10, 1e-3]),
        rich=dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
    AlgorithmSpec("RMSprop", "rmsprop", base=dict(lr=0.01), grid=dict(
        alpha=[0.99, 0.9], eps=[1e-8, 1e-3], weight_decay=[0.0, 0.1], momentum=[0.0, 0.9],
        centered=[False, True], maximize=[False, True]),
        rich=dict(lr=0.01, alpha=0.9, weight_decay=0.1, momentum=0.9, centered=True)),
    AlgorithmSpec("Adamax", "adamax", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.999), (0.5, 0.9)], eps=[1e-8, 1e-3], weight_decay=[0.0, 0.1], maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1)),
    AlgorithmSpec("Adadelta", "adadelta", base=dict(lr=1.0), grid=dict(
        rho=[0.9, 0.5], eps=[1e-6, 1e-3], weight_decay=[0.0, 0.1], maximize=[False, True]),
        rich=dict(lr=1.0, rho=0.5, weight_decay=0.1)),
    AlgorithmSpec("NAdam", "nadam", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.999), (0.5, 0.9)], weight_decay=[0.0, 0.1], momentum_decay=[4e-3, 0.05],
        decoupled_weight_decay=[False, True], maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1, momentum_decay=0.05, decoupled_weight_decay=True)),
    AlgorithmSpec("Rprop", "rprop", base=dict(lr=0.01), grid=dict(
        lr=[0.01, 0.1], etas=[(0.5, 1.2), (0.3, 1.5)], step_sizes=[(1e-6, 50), (1e-3, 0.05)], maximize=[False, True]),
        rich=dict(lr=0.01, etas=(0.3, 1.5), step_sizes=(1e-3, 0.05))),
    AlgorithmSpec("Adafactor", "adafactor", base=dict(lr=0.01), grid=dict(
        beta2_decay=[-0.8, -0.5], eps=[(None, 1e-3), (1e-30, 1e-2)], d=[1.0, 1.5], weight_decay=[0.0, 0.1],
        maximize=[False, True]),
        rich=dict(lr=0.05, beta2_decay=-0.5, eps=(1e-30, 1e-2), d=1.5, weight_decay=0.1)),
    AlgorithmSpec("RAdam", "radam", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.999), (0.5, 0.9)], eps=[1e-8, 1e-3], weight_decay=[0.0, 0.1],
        decoupled_weight_decay=[False, True], maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1, decoupled_weight_decay=True)),
    AlgorithmSpec("ASGD", "asgd", base=dict(lr=0.05), grid=dict(
        lambd=[1e-4, 1e-2], alpha=[0.75, 0.5], t0=[1e6, 5.0], weight_decay=[0.0, 0.1], maximize=[False, True]),
        rich=dict(lr=0.05, lambd=1e-2, alpha=0.5, t0=5.0, weight_decay=0.1)),
    AlgorithmSpec("Lion", "lion", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.99), (0.5, 0.8)], weight_decay=[0.0, 0.1], maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.5, 0.8), weight_decay=0.1)),
    AlgorithmSpec("Muon", "muon", base=dict(lr=0.02), grid=dict(
        weight_decay=[0.0, 0.1], momentum=[0.95, 0.5], nesterov=[True, False],
        ns_coefficients=[(3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5)], eps=[1e-7, 0.1], ns_steps=[5, 2],
        adjust_lr_fn=[None, "match_rms_adamw"]),
        rich=dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_steps=3, adjust_lr_fn="match_rms_adamw")),
    # d_coef / growth_rate / beta3 values: tests/optimizers/test_prodigy.py's configurations
    AlgorithmSpec("Prodigy", "prodigy", base=dict(lr=1.0, d_coef=2.0), grid=dict(
        betas=[(0.9, 0.999), (0.0, 0.99)], weight_decay=[0.0, 0.1], decouple=[True, False],
        use_bias_correction=[False, True], safeguard_warmup=[False, True], slice_p=[1, 3]),
        rich=dict(lr=1.0, weight_decay=0.1, use_bias_correction=True, d_coef=2.0, growth_rate=1.5)),
    AlgorithmSpec("AdamWScheduleFree", "schedulefree", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.999), (0.5, 0.9)], weight_decay=[0.0, 0.1], warmup_steps=[0, 3], r=[0.0, 1.0],
        weight_lr_power=[2.0, 0.0], eps=[1e-8, 1e-3]),
        rich=dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1, warmup_steps=3, r=0.5)),
    AlgorithmSpec("SGDScheduleFree", "schedulefree", base=dict(lr=0.1), grid=dict(
        momentum=[0.9, 0.5], weight_decay=[0.0, 0.1], warmup_steps=[0, 3], r=[0.0, 1.0], weight_lr_power=[2, 0.0]),
        rich=dict(lr=0.1, momentum=0.5, weight_decay=0.1, warmup_steps=3, r=0.5)),
    AlgorithmSpec("ADOPT", "adopt", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.9999), (0.5, 0.9)],
        clip_lambda=[importlib.import_module(f"{__package__}.optimizers.adopt").default_clip_lambda, None],
        weight_decay=[0.0, 0.1], weight_decouple=[False, True], fixed_decay=[False, True], eps=[1e-6, 1e-3],
        maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1, weight_decouple=True)),
    AlgorithmSpec("AdEMAMix", "ademamix", base=dict(lr=0.01), grid=dict(
        betas=[(0.9, 0.999, 0.9999), (0.5, 0.9, 0.99)], weight_decay=[0.0, 0.1], weight_decouple=[False, True],
        fixed_decay=[False, True], alpha=[5.0, 0.5], t_alpha_beta3=[None, 10.0], maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.5, 0.9, 0.99), weight_decay=0.1, weight_decouple=True, alpha=2.0,
                  t_alpha_beta3=10.0, eps=1e-3)),
    # max_precondition_dim=6: a dimension of 7 gets no factor; merge_dims is in tests/optimizers/test_soap.py
    # (the oracle fails on a vector with it, and the shared tests step vectors).  rich: no factor larger than
    # the product of its parameter's other dimensions on the shared tests' models (max_precondition_dim=4, no
    # precondition_1d): the first eigenbasis of such a rank-deficient factor is arbitrary in its null space, so a
    # last-bit change of a gradient (ZeRO at W=4 averages in another order) moves SOAP, the oracle too, by ~1%
    AlgorithmSpec("SOAP", "soap", base=dict(lr=0.01, precondition_frequency=3, max_precondition_dim=6), grid=dict(
        weight_decay=[0.0, 0.1], precondition_1d=[False, True], correct_bias=[True, False],
        normalize_gradient=[False, True], maximize=[False, True]),
        rich=dict(lr=0.01, betas=(0.9, 0.99), shampoo_beta=0.8, weight_decay=0.1, precondition_frequency=2,
                  max_precondition_dim=4)),
]

REGISTRY: Dict[str, AlgorithmSpec] = {s.name: s for s in _SPECS}


@functools.lru_cache(maxsize=None)
def _takes(torch_cls: type, shape: tuple, dtype: torch.dtype, base: tuple) -> bool:
    p = torch.zeros(shape, dtype=dtype, requires_grad=True)
    try:
        opt = torch_cls([p], **dict(base))
        if callable(getattr(opt, "train", None)):  # Schedule-Free's oracle steps in train mode only
            opt.train()
        p.grad = torch.ones_like(p)
        opt.step()
    except (RuntimeError, ValueError, TypeError, ZeroDivisionError, NotImplementedError):
        return False
    return True


def resolve_oracle(oracle: Union[type, str], name: str = "") -> type:
    """``oracle`` itself, or the class a ``"module:Class"`` string names (imported)."""
    if not isinstance(oracle, str):
        return oracle
    module, _, attr = oracle.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ImportError(f"the oracle of {name or attr} is {module}.{attr}, from a package funcopt tests against "
                          f"but does not need at run time; install it (pip install 'funcopt[test]'): {e}") from e


def _loaded_oracle(spec: AlgorithmSpec) -> Any:
    """The oracle class if it is a torch class or its module is already imported
    (lookups never import a test-only package)."""
    oracle = spec.cls.torch_class
    if not isinstance(oracle, str):
        return oracle
    module, _, attr = oracle.partition(":")
    return getattr(sys.modules[module], attr, None) if module in sys.modules else None


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add an algorithm defined outside funcopt (its formula file + this one
    call); every layer (tests, docs, ZeRO, RPC, ``funcopt.<Name>``) sees it.

    Example::

        >>> import funcopt
        >>> from funcopt.registry import AlgorithmSpec, register
        >>> # register(AlgorithmSpec("Toy", ToyClass, base=dict(lr=0.1), grid=dict(momentum=[0.0, 0.5])))

    Raises ``ValueError`` if the name is taken.
    """
    if spec.name in REGISTRY:
        raise ValueError(f"an algorithm named {spec.name!r} is already registered")
    _SPECS.append(spec)
    REGISTRY[spec.name] = spec
    import funcopt  # the package is imported by now (we are its submodule)

    setattr(funcopt, spec.name, spec.cls)
    return spec


def unregister(name: str) -> None:
    """Remove an algorithm added with :func:`register` (tests)."""
    spec = REGISTRY.pop(name)
    _SPECS.remove(spec)
    import funcopt

    if getattr(funcopt, name, None) is spec.cls:
        delattr(funcopt, name)


def get(name_or_class: Any) -> AlgorithmSpec:
    """Look up by name, funcopt class or the matching torch.optim class.

    Raises:
      TypeError: ``name_or_class`` is ``torch.optim.LBFGS`` or
        ``torch.optim.SparseAdam`` (a subclass, an instance or the name of
        one): not an update rule funcopt has (see :func:`refuse_out_of_scope`).
      KeyError: anything else that is not registered.
    """
    for spec in _SPECS:
        if name_or_class in (spec.name, spec.cls) or (
                isinstance(name_or_class, type) and name_or_class is _loaded_oracle(spec)):
            return spec
    refuse_out_of_scope(name_or_class, "funcopt.registry.get")
    raise KeyError(
        f"no funcopt algorithm for {name_or_class!r}; known: {', '.join(REGISTRY)}"
    )


# torch.optim classes funcopt does not implement, and why
_OUT_OF_SCOPE = {
    "LBFGS": "its step is a closure-driven line search, not an update rule over a gradient list",
    "SparseAdam": "it is defined for sparse gradients only; use Adam (dense) or Adagrad/SGD (sparse COO)",
}


def out_of_scope(obj: Any) -> Optional[str]:
    """The name of the out-of-scope ``torch.optim`` class (``"LBFGS"``, ``"SparseAdam"``)
    that ``obj`` is, subclasses, is an instance of, or names; else ``None``."""
    if isinstance(obj, str):
        return obj if obj in _OUT_OF_SCOPE else None
    cls = obj if isinstance(obj, type) else type(obj)
    for name in _OUT_OF_SCOPE:
        base = getattr(torch.optim, name, None)
        if isinstance(base, type) and issubclass(cls, base):
            return name
    return None


def refuse_out_of_scope(obj: Any, where: str, also: str = "") -> None:
    """Raise ``TypeError`` if ``obj`` is ``torch.optim.LBFGS`` or ``torch.optim.SparseAdam``
    (the class, a subclass, an instance or the name): funcopt has no such update
    rule, and running one per shard or per worker would not be that algorithm on
    the model.  Every layer that maps an optimizer class to a funcopt rule (ZeRO,
    ZeRO-3 checkpoints, the RPC optimizer, ``funcopt.script``) calls this first,
    before it changes anything or talks to another rank.  The message says why
    and names what is supported (``also``: what else ``where`` takes)."""
    name = out_of_scope(obj)
    if name is None:
        return
    label = getattr(obj, "__qualname__", None) or (obj if isinstance(obj, str) else type(obj).__qualname__)
    what = name if label == name else f"{label} (a torch.optim.{name})"
    raise TypeError(
        f"{where}: funcopt has no {what}: {_OUT_OF_SCOPE[name]}; supported: {', '.join(REGISTRY)}"
        + (f"{also}" if also else "")
    )


def markdown() -> str:
    """``docs/optimizers.md``, generated from the registry (a test keeps them equal).

    Regenerate with ``python -c "import funcopt.registry as r; print(r.markdown(), end='')" > docs/optimizers.md``.
    """
    import inspect as _inspect
    import sys as _sys

    lines = [
        "# Optimizers",
        "",
        "Generated from `funcopt.registry`; regenerate with",
        "`python -c \"import funcopt.registry as r; print(r.markdown(), end='')\" > docs/optimizers.md`",
        "(a test fails when this page and the registry disagree).",
        "Every algorithm is tested bit for bit against the `torch.optim` class of the same",
        "name (an algorithm torch.optim lacks: its reference package's class -- `schedulefree`,",
        "`prodigyopt`, `pytorch_optimizer` -- the test-only oracles in `funcopt[test]`), fused and foreach: eager float32 over its whole grid (every combination torch",
        "accepts); float64 and scripted over the grid's pairwise cover (every value of every",
        "option and every pair of values; `FUNCOPT_FULL_GRID=1`: the whole grid), and under",
        "`torch.compile(fullgraph=True)`.",
        "Where torch's foreach and for-loop versions differ (ASGD in float64), funcopt follows foreach.",
        "`LBFGS` (a closure-driven line search) and `SparseAdam` (sparse gradients only) are not",
        "update rules over a gradient list; looking them up (e.g. `ZeroRedundancyOptimizer(params,",
        "torch.optim.LBFGS)`) raises an error that says so.",
        "",
        "**Adding an algorithm** takes one formula file and one registry line: the file holds the",
        "update rule over tensor lists (foreach ops, the fused ATen call where one exists), a small",
        "kernel class (`init`, `check`, `dense`, `single`: the `Kernel` interface in",
        "`funcopt/optimizers/_core.py`, whose shared core does validation, `None` gradients, AMP,",
        "step counters, complex and strided tensors) and a thin `torch.optim`-compatible class; the",
        "line is an `AlgorithmSpec` in `funcopt/registry.py` (or `funcopt.registry.register(...)` from",
        "your own module). Tests, this page, the API reference, ZeRO, the RPC optimizer and the",
        "benchmarks read the registry; `tests/test_extending.py` proves it with a toy algorithm.",
        "",
        "| algorithm | funcopt | oracle | state (torch format) | fused kernel on | grid tested |",
        "|---|---|---|---|---|---|",
    ]
    import contextlib
    import io

    def shown(v: Any) -> str:  # a grid value as the page shows it (a function by name: no address)
        if isinstance(v, list):
            return "[" + ", ".join(shown(x) for x in v) + "]"
        return v.__name__ if callable(v) and hasattr(v, "__name__") else repr(v)

    for spec in _SPECS:
        state = ", ".join(f"`{n}`" + (f" (if `{c}`)" if c else "") for n, c in spec.cls.slots)
        grid = "; ".join(f"{k} in {shown(v)}" for k, v in spec.grid.items())
        with contextlib.redirect_stdout(io.StringIO()):  # an oracle that prints (prodigyopt)
            n = len(list(spec.combos()))
        oracle = spec.cls.torch_class
        oracle = oracle.replace(":", ".") if isinstance(oracle, str) else f"torch.optim.{oracle.__name__}"
        lines.append(
            f"| {spec.name} | `funcopt.{spec.cls.__name__}` | `{oracle}` "
            f"| {state} | {', '.join(spec.fused_devices)} | {n} combos: {grid} |"
        )
    for spec in _SPECS:
        module = _sys.modules[spec.cls.__module__]
        sig = str(_inspect.signature(spec.cls.__init__)).replace("self, ", "")
        sig = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", sig)  # a function default, by name
        lines += ["", f"## {spec.name}", "", f"`funcopt.{spec.cls.__name__}{sig}`", ""]
        lines += [_inspect.cleandoc(module.__doc__ or ""), ""]
        lines += [_inspect.cleandoc(spec.cls.__doc__ or "")]
    return "\n".join(lines) + "\n"


"""The oracles outside torch (``schedulefree``, ``prodigyopt``, ``pytorch_optimizer``), used
the way their own docs say, so that the registry-driven tests can treat them like
``torch.optim`` classes.  Imported by ``tests/conftest.py`` and by the spawned children of
the distributed tests (``_dist_harness.py``); changes no number an oracle computes:

* a Schedule-Free oracle is put in train mode when it is built (its docs: ``train()``
  before stepping; funcopt's classes start in train mode);
* an oracle's ``step()`` sees clones of the gradients and the caller's ``p.grad`` tensors are
  put back afterwards (these oracles write into ``p.grad``: Schedule-Free divides it,
  Prodigy adds coupled decay, pytorch_optimizer negates it for ``maximize``; torch.optim
  never does, and the shared tests hand the same gradient tensors to both sides);
* ``state_dict()`` leaves out the empty entries that an oracle's ``train()``/``eval()``
  create for parameters without state (its ``self.state[p]`` is a defaultdict).

Only classes that ``funcopt.registry`` names as an oracle of an algorithm with a
``"module:Class"`` oracle are touched, once per process.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Dict, List, Tuple

import torch

_DONE: List[bool] = []


def other_lr(spec, lr):
    """An lr for a second param group that the algorithm takes: ``lr / 2``, or 0 for a rule
    whose groups may differ in lr only by 0 (Prodigy: one step size ``d`` for all)."""
    return 0.0 if getattr(spec.cls, "one_lr", False) else lr * 0.5


def instance_keys(spec) -> tuple:
    """Options that an oracle outside torch keeps on its instance, not in its param groups
    (pytorch_optimizer's ``maximize``, ADOPT's ``clip_lambda``, SOAP's ``data_format``:
    each funcopt module's ``INSTANCE_KEYS``), and those on which it gives no verdict funcopt
    could follow (Prodigy's ``fsdp_in_use``: ``NO_ORACLE_VERDICT``)."""
    module = sys.modules[spec.cls.__module__]
    return tuple(getattr(module, "INSTANCE_KEYS", ())) + tuple(getattr(module, "NO_ORACLE_VERDICT", ()))


def without_instance_keys(spec, group: dict, oracle_group: dict) -> dict:
    """``group`` less the instance keys the oracle's ``oracle_group`` does not hold."""
    keys = set(instance_keys(spec)) - set(oracle_group)
    return {k: v for k, v in group.items() if k not in keys}


def oracle_form(a, b):
    """``(a, b)`` as comparable values when one side's state is in an oracle's own form
    that funcopt stores otherwise: prodigyopt's Python int ``step`` (funcopt: torch's 0-d
    float32 counter) and its 0-d zero ``p0`` of an all-zero parameter (funcopt: the strided
    zeros).  Anything else unchanged."""
    for x, y, swap in ((a, b, False), (b, a, True)):
        if isinstance(x, torch.Tensor) and x.dim() == 0 and isinstance(y, int) and not isinstance(y, bool):
            y = torch.tensor(float(y), dtype=x.dtype)
        elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.dim() == 0 < x.dim():
            y = y.to(x.dtype).expand_as(x)
        else:
            continue
        return (y, x) if swap else (x, y)
    return a, b


def groups_equal(a: list, b: list) -> bool:
    """Equal param groups; float values to 1e-12 relative (a two-phase rule's sums over several
    groups -- Prodigy's d_numerator -- add per-group partial sums, the oracle one running sum)."""
    import math

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for k in x:
            u, v = x[k], y[k]
            if type(u) is float and type(v) is float:
                if not (u == v or math.isclose(u, v, rel_tol=1e-12, abs_tol=1e-300)):
                    return False
            elif u != v:
                return False
    return True


def same_value(a, b) -> bool:
    """Equal state values: tensors bitwise with the same dtype, lists element by element
    (SOAP's ``GG``/``Q``), anything else by ``==`` (an oracle outside torch may keep a Python
    int, e.g. Prodigy's per-parameter ``step``, or SOAP's ``precondition_frequency``)."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_value(x, y) for x, y in zip(a, b)))
    a, b = oracle_form(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    return a == b and type(a) is type(b)


def _patch(cls: type, modes: bool) -> None:
    if getattr(cls, "_funcopt_test_glue", False):
        return
    init, step, state_dict = cls.__init__, cls.step, cls.state_dict

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if modes:
            self.train()

    @functools.wraps(step)
    def step_(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g.clone()
        try:
            return step(self, *args, **kwargs)
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    @functools.wraps(state_dict)
    def state_dict_(self: Any) -> Any:
        out = state_dict(self)
        out["state"] = {k: v for k, v in out["state"].items() if not (isinstance(v, dict) and not v)}
        return out

    cls.__init__ = __init__
    cls.step = step_
    cls.state_dict = state_dict_
    cls._funcopt_test_glue = True


class _PatchOnImport:
    """A ``sys.meta_path`` finder that patches an oracle's classes right after its module is
    first imported: importing ``pytorch_optimizer`` costs about a second per process (it
    pulls DTensor in), and most spawned ranks and test processes never use an oracle."""

    def __init__(self) -> None:
        self.todo: Dict[str, List[Tuple[str, bool]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.todo:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        classes, loader = self.todo.pop(name), spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            for cls_name, modes in classes:
                _patch(getattr(module, cls_name), modes)

        loader.exec_module = exec_and_patch  # this spec's loader object only (one per import)
        return spec


def install() -> None:
    """Patch every oracle outside torch that is installed (once per process): at once where
    its module is already imported, else when it is first imported."""
    if _DONE:
        return
    _DONE.append(True)
    from funcopt.registry import REGISTRY

    hook = _PatchOnImport()
    for spec in REGISTRY.values():
        if spec.oracle_package is None:
            continue
        module, _, cls_name = spec.cls.torch_class.partition(":")
        modes = bool(getattr(spec.cls, "has_modes", False))
        if module in sys.modules:
            _patch(getattr(sys.modules[module], cls_name), modes)
        else:
            hook.todo.setdefault(module, []).append((cls_name, modes))
    if hook.todo:
        sys.meta_path.insert(0, hook)

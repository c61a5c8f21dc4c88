"""Constructor signatures: every registered class takes its oracle's arguments.

For every algorithm of the registry, ``inspect.signature`` of funcopt's
``__init__`` against its oracle's (``spec.torch_cls``: the ``torch.optim``
class, or Lion's plain reference optimizer), on the installed torch:

* the positional parameters are the oracle's, same names, same order, same
  defaults (a positional call that works with torch's class lands every value
  in the same slot);
* the oracle's keyword-only parameters are keyword-only here too, with the
  same defaults;
* funcopt's own options (``impl``, ...) are keyword-only.

A torch release that adds a parameter funcopt lacks fails here, naming it.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List

import pytest
import torch

from _oracles import without_instance_keys
from funcopt.registry import REGISTRY

NAMES = list(REGISTRY)
P = inspect.Parameter


def _params_of(cls: type) -> List[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self


def _same_default(a: Any, b: Any) -> bool:
    if a is P.empty or b is P.empty:
        return a is b
    if callable(a) and callable(b) and not isinstance(a, type):  # ADOPT's clip_lambda: the same function
        return all(a(t) == b(t) for t in (1, 2, 10, 1000))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", NAMES)
def test_positional_parameters_are_torchs(name):
    spec = REGISTRY[name]
    ours = [p for p in _params_of(spec.cls) if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    theirs = [p for p in _params_of(spec.torch_cls) if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    qual = spec.torch_cls.__qualname__
    assert [p.name for p in ours] == [p.name for p in theirs], (
        f"{name}: positional parameters {[p.name for p in ours]}, {qual} (torch {torch.__version__}) has "
        f"{[p.name for p in theirs]}")
    for a, b in zip(ours, theirs):
        assert _same_default(a.default, b.default), (
            f"{name}({a.name}=...): default {a.default!r}, {qual} has {b.default!r}")


@pytest.mark.parametrize("name", NAMES)
def test_keyword_only_parameters_match_and_extras_are_keyword_only(name):
    spec = REGISTRY[name]
    ours = {p.name: p for p in _params_of(spec.cls)}
    theirs = {p.name: p for p in _params_of(spec.torch_cls)}
    missing = [n for n, p in theirs.items() if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and n not in ours]
    assert not missing, (f"{name}: {spec.torch_cls.__qualname__} (torch {torch.__version__}) has {missing}, "
                         f"funcopt.{name} does not")
    for n, b in theirs.items():
        if b.kind is P.KEYWORD_ONLY:
            a = ours[n]
            assert a.kind is P.KEYWORD_ONLY, f"{name}({n}): keyword-only in torch, {a.kind.description} here"
            assert _same_default(a.default, b.default), f"{name}({n}=...): default {a.default!r}, torch {b.default!r}"
    extras = [p for n, p in ours.items() if n not in theirs]
    assert "impl" in [p.name for p in extras], f"{name}: no impl= option"
    for p in extras:
        assert p.kind is P.KEYWORD_ONLY, f"{name}({p.name}): funcopt's own option must be keyword-only"
        assert p.default is not P.empty, f"{name}({p.name}): funcopt's own option needs a default"


def _hyper(opt: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _positional_values(spec) -> List[Any]:
    """A value for every positional parameter after ``params`` that torch's class accepts
    all together: ``spec.rich``'s, else the first grid value other than the default that
    torch still accepts, else the default."""
    names = [p for p in _params_of(spec.torch_cls)[1:] if p.kind is P.POSITIONAL_OR_KEYWORD]
    chosen: Dict[str, Any] = {p.name: spec.rich[p.name] if p.name in spec.rich else p.default for p in names}
    probe = lambda: [torch.zeros(spec.probe_shape, requires_grad=True)]  # noqa: E731
    for p in names:
        if p.name in spec.rich:
            continue
        for v in spec.grid.get(p.name, []):
            if _same_default(v, p.default):
                continue
            try:
                spec.torch_cls(probe(), *dict(chosen, **{p.name: v}).values())
            except (TypeError, ValueError, RuntimeError):
                continue
            chosen[p.name] = v
            break
    return list(chosen.values())


@pytest.mark.parametrize("name", NAMES)
def test_a_positional_call_gives_torchs_param_groups(name):
    spec = REGISTRY[name]
    args = _positional_values(spec)
    ref = spec.torch_cls([torch.zeros(spec.probe_shape, requires_grad=True)], *args)
    ours = spec.cls([torch.zeros(spec.probe_shape, requires_grad=True)], *args)
    assert [without_instance_keys(spec, a, b) for a, b in zip(_hyper(ours), _hyper(ref))] == _hyper(ref)
    defaults = _hyper(spec.torch_cls([torch.zeros(spec.probe_shape, requires_grad=True)]))
    assert _hyper(ref) != defaults, f"{name}: the positional call set nothing: {args}"
    # one positional argument more than torch takes: refused by both (no funcopt option takes it)
    for cls in (spec.torch_cls, spec.cls):
        with pytest.raises(TypeError, match="positional"):
            cls([torch.zeros(spec.probe_shape, requires_grad=True)], *args, "auto")

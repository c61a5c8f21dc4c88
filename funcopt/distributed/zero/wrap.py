"""``zero3(module, wrap=...)``: ZeRO-3 for an arbitrary model.

Every submodule that ``wrap`` selects becomes a :class:`Zero3Layer` in place
(its parent now calls the layer); the parameters left outside them (embeddings,
a final norm, a head...) form one more layer, owned by the returned root, which
stays gathered for the whole forward and backward.  The order in which the
layers run on the first forward is recorded (and checked to be the same on
every rank); from the second forward on, each layer prefetches the next one in
that order, and in backward the previous one -- right for residual and
branching models, whatever the modules' registration order.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from .root3 import Zero3Root
from .schedule3 import owned_parameters
from .stage3 import Zero3Layer

WrapPolicy = Union[None, type, Iterable[type], Callable[[nn.Module], bool]]


def _policy(wrap: WrapPolicy) -> Callable[[nn.Module], bool]:
    if wrap is None:
        return lambda m: False
    if isinstance(wrap, type):
        wrap = (wrap,)
    if callable(wrap) and not isinstance(wrap, (set, frozenset, list, tuple)):
        return wrap  # type: ignore[return-value]
    types = tuple(wrap)  # type: ignore[arg-type]
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"zero3: wrap must be nn.Module subclasses or a predicate, got {t!r}")
    return lambda m: isinstance(m, types)


def _select(module: nn.Module, match: Callable[[nn.Module], bool]) -> List[Tuple[str, nn.Module, nn.Module, str]]:
    """``(path, submodule, parent, attribute)`` of every outermost matching submodule."""
    out: List[Tuple[str, nn.Module, nn.Module, str]] = []
    where: Dict[int, str] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, child in mod._modules.items():
            if child is None:
                continue
            path = prefix + name
            if isinstance(child, Zero3Layer):
                raise ValueError(f"zero3: {path!r} is already a Zero3Layer")
            if match(child):
                if id(child) in where:
                    raise ValueError(f"zero3: one module is at both {where[id(child)]!r} and {path!r}; "
                                     "a wrapped module must appear once")
                where[id(child)] = path
                if sum(p.numel() for p in child.parameters()) > 0:
                    out.append((path, child, mod, name))
                continue
            visit(child, path + ".")

    visit(module, "")
    return out


class Zero3Model(Zero3Root, Zero3Layer):
    """The root :func:`zero3` returns: a :class:`Zero3Layer` over the
    parameters outside the wrapped submodules, running the whole model.

    ``parameters()`` yields every chunk (the root's and each layer's);
    ``full_state_dict()`` has exactly the keys of the original model's
    ``state_dict()``.  Built by :func:`zero3`.
    """

    def __init__(self, module: nn.Module, layers: List[Tuple[str, Zero3Layer]], keys: List[str], *,
                 process_group: Any, grad_reduce: str, compute_dtype: Optional[torch.dtype]):
        Zero3Layer.__init__(self, module, process_group=process_group, grad_reduce=grad_reduce,
                            compute_dtype=compute_dtype)
        self.label = "<root>"
        self.__dict__["_zero3_layers"] = list(layers)  # registered already, under the model
        self.__dict__["_zero3_keys"] = list(keys)
        schedule = self.schedule
        schedule.outer = self
        for path, layer in layers:
            layer.attach(schedule)

    def zero3_units(self) -> List[Tuple[str, Zero3Layer]]:
        """The root's own layer (no prefix), then each wrapped layer under its path."""
        return [("", self)] + [(path + ".", layer) for path, layer in self.__dict__["_zero3_layers"]]

    def full_key_order(self) -> Optional[List[str]]:
        """The original model's ``state_dict()`` key order."""
        return self.__dict__["_zero3_keys"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model: the root's parameters gathered throughout, each layer in turn."""
        self.schedule.begin_forward()
        out = self.run_forward(self.module, args, kwargs)
        self.schedule.end_forward()
        return out


def zero3(module: nn.Module, wrap: WrapPolicy = None, *, process_group: Any = None, grad_reduce: str = "mean",
          compute_dtype: Optional[torch.dtype] = None) -> Zero3Model:
    """Shard an arbitrary model ZeRO-3 style; returns the root to train.

    Each submodule selected by ``wrap`` (the outermost ones: a selected module's
    children are part of it) becomes a :class:`Zero3Layer` in place; the
    parameters outside them become one more layer, held by the returned root,
    gathered for the whole forward and backward.  Prefetch follows the order
    the layers ran in on the first forward (checked to be the same on every
    rank).  ``module`` is changed in place (its wrapped submodules replaced);
    use the returned root from then on.  Call on every rank, with the same model.

    Peak parameter memory per rank: the chunks (1/W of the model) plus the
    root's parameters, the running layer and one prefetched layer.

    Args:
      module: the model (its parameters on their device and dtype already).
      wrap: a set of submodule types (e.g. ``{nn.TransformerEncoderLayer}``) or
        a predicate ``module -> bool``; ``None`` (default) wraps nothing (the
        whole model is the root's one layer).
      process_group: as for :class:`Zero3Layer`.
      grad_reduce: as for :class:`Zero3Layer`.
      compute_dtype: as for :class:`Zero3Layer`.

    Raises:
      ValueError: a parameter is shared by two layers (the error names both),
        or a wrapped module appears at two places.

    Example::

        model = zero3(MyTransformer(), wrap={nn.TransformerEncoderLayer})
        opt = funcopt.Adam(model.parameters(), lr=1e-3)
        model(x).sum().backward()
        opt.step()
        sd = model.full_state_dict()   # keys of MyTransformer().state_dict() on rank 0
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"zero3: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, Zero3Layer):
        raise ValueError("zero3: module is already a Zero3Layer")
    selected = _select(module, _policy(wrap))
    owner: Dict[int, Tuple[str, str]] = {}  # id(param) -> (layer, parameter name)
    for path, sub, _, _ in selected:
        for name, _, _, p in owned_parameters(sub):
            _claim(owner, p, path, f"{path}.{name}")
    inner = {id(sub) for _, sub, _, _ in selected}
    for name, p in _outside(module, inner):
        _claim(owner, p, "<root>", name)
    keys = list(module.state_dict(keep_vars=True).keys())
    layers: List[Tuple[str, Zero3Layer]] = []
    for path, sub, parent, attr in selected:
        layer = Zero3Layer(sub, process_group=process_group, grad_reduce=grad_reduce, compute_dtype=compute_dtype)
        layer.label = path
        parent._modules[attr] = layer
        layers.append((path, layer))
    return Zero3Model(module, layers, keys, process_group=process_group, grad_reduce=grad_reduce,
                      compute_dtype=compute_dtype)


def _claim(owner: Dict[int, Tuple[str, str]], p: nn.Parameter, layer: str, name: str) -> None:
    prev = owner.get(id(p))
    if prev is not None and prev[0] != layer:
        raise ValueError(f"zero3: parameter {prev[1]!r} of layer {prev[0]!r} is shared with layer {layer!r} "
                         f"(as {name!r}); a parameter must belong to one layer: wrap the modules that share "
                         "it together, or leave them to the root")
    owner.setdefault(id(p), (layer, name))


def _outside(module: nn.Module, inner: set) -> List[Tuple[str, nn.Parameter]]:
    out: List[Tuple[str, nn.Parameter]] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is not None:
                out.append((prefix + attr, p))
        for name, child in mod._modules.items():
            if child is not None and id(child) not in inner:
                visit(child, prefix + name + ".")

    visit(module, "")
    return out

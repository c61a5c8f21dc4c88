"""What the ZeRO-3 layers of one root share, and their bookkeeping.

* :class:`Zero3Schedule`: the execution order (prefetch), one gradient
  bucketer, the per-iteration backward state and the end-of-backward callback;
* :class:`ChunkInfo`: one rank's piece of a flat chunk (for sharded checkpoints);
* ``owned_parameters`` / ``state_entries``: which parameters and state-dict
  entries a layer owns (never descending into a nested ZeRO-3 layer, marked
  by the class attribute ``zero3_layer = True``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from .._comm import check_same
from ..bucketer import ReduceScatterBucketer

GRAD_REDUCE = ("mean", "sum")
TRAINABLE, FROZEN = 0, 1
KINDS = ("trainable", "frozen")


@dataclass
class ParamEntry:
    """One original parameter of a layer: where it lives in its kind's flat."""

    name: str  # qualified name within the wrapped module (first name if tied)
    kind: int  # TRAINABLE or FROZEN
    offset: int  # element offset within the kind's flat (unpadded part)
    shape: torch.Size
    param: nn.Parameter
    aliases: List[Tuple[nn.Module, str]] = field(default_factory=list)  # (owner, attribute) of every name

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class ChunkInfo:
    """This rank's piece of one flat chunk (what a sharded checkpoint stores).

    ``tensor`` is the local chunk (an ``nn.Parameter``, 1-D, ``length``
    elements).  Globally the chunk is a flat of ``numel`` real elements (padded
    to ``length * world``); this rank holds ``[offset, offset + length)`` of it,
    of which the first ``valid`` elements are real and the rest padding.
    ``params`` lists ``(full state-dict key, flat offset, shape)`` of the
    parameters in the flat, in order.
    """

    name: str
    tensor: Tensor
    trainable: bool
    offset: int
    length: int
    valid: int
    numel: int
    world: int
    params: Tuple[Tuple[str, int, Tuple[int, ...]], ...]


def owned_parameters(module: nn.Module) -> List[Tuple[str, nn.Module, str, nn.Parameter]]:
    """``(qualified name, owner, attribute, parameter)`` for every parameter
    reference under ``module``, not descending into nested :class:`Zero3Layer`
    (they own theirs); a tied parameter appears once per name."""
    out: List[Tuple[str, nn.Module, str, nn.Parameter]] = []
    seen_modules: set = set()

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is not None:
                out.append((prefix + attr, mod, attr, p))
        if id(mod) in seen_modules:
            return
        seen_modules.add(id(mod))
        for name, child in mod._modules.items():
            if child is not None and not getattr(child, "zero3_layer", False):
                visit(child, prefix + name + ".")

    visit(module, "")
    return out


def state_entries(module: nn.Module) -> List[Tuple[str, str, Any]]:
    """``module.state_dict()``'s keys in order, as ``(key, "param", parameter)``
    or ``(key, "buffer", (owner, attribute))``, not descending into nested
    :class:`Zero3Layer`."""
    out: List[Tuple[str, str, Any]] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        for attr, p in mod._parameters.items():
            if p is not None:
                out.append((prefix + attr, "param", p))
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set:
                out.append((prefix + attr, "buffer", (mod, attr)))
        for name, child in mod._modules.items():
            if child is not None and not getattr(child, "zero3_layer", False):
                visit(child, prefix + name + ".")

    visit(module, "")
    return out


class PostBackward(torch.autograd.Function):
    """Identity on a frozen-only layer's inputs; its backward runs once the
    layer's backward has produced every input gradient: the layer can go."""

    @staticmethod
    def forward(ctx: Any, layer: "Any", *tensors: Tensor) -> Any:  # type: ignore[override]
        ctx.layer = layer
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.layer.backward_done()
        return (None,) + grads


class Zero3Schedule:
    """What the layers of one root share: the process group, the execution
    order (recorded on the first forward unless given), one
    :class:`ReduceScatterBucketer` and the per-iteration backward state.

    Not constructed by users: every :class:`Zero3Layer` starts with its own,
    and a root hands its own to all its layers.
    """

    def __init__(self, group: Any, order: Optional[Sequence[Any]] = None, root: Any = None):
        self.group = group
        # Every layer's flat gradient goes straight to its own reduce-scatter (no
        # bucket copy), and at most one is left running: handing layer k over waits
        # for layer k+1's, so the full-size gradients alive in backward are the
        # running layer's plus one pending layer's (two layers, not ~6 behind gloo).
        self.bucketer = ReduceScatterBucketer(bucket_size_mb=0, max_in_flight=1)
        self.pending_grad_bytes = 0  # full-size gradient bytes handed over, not yet reduced
        self.peak_pending_grad_bytes = 0  # the most ``pending_grad_bytes`` has been
        self.order: List[Any] = list(order or [])
        self.recording = order is None
        self.root = root  # the module whose forward starts an iteration
        self.outer: Optional[Any] = None  # a layer that holds params used all forward (zero3's root)
        self.active: List[Any] = []  # layers with backward work this iteration
        self.in_backward = False
        self.checked_order = order is not None

    def layers(self) -> List["Any"]:
        """Every layer of the root (the root's own first, for zero3)."""
        return ([self.outer] if self.outer is not None else []) + self.order

    # ------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        """Start an iteration: drop what a forward without backward left."""
        if self.in_backward:  # a forward inside backward (recomputation): leave state alone
            return
        for layer in self.layers():
            layer.reset_iteration()
        self.active = []

    def end_forward(self) -> None:
        """End of the root's forward: the first one fixes (and checks) the execution order."""
        if self.recording:
            self.recording = False
        if not self.checked_order:
            self.checked_order = True
            names = [layer.label for layer in self.order]
            check_same(names, self.group, "zero3 execution order recorded on the first forward")

    def saw_forward(self, layer: "Any") -> None:
        """A layer's forward starts (recorded in the execution order on the first forward)."""
        if self.recording and layer is not self.outer and layer not in self.order:
            layer.layer_idx = len(self.order)
            self.order.append(layer)

    def next_of(self, layer: "Any") -> Optional["Any"]:
        """The layer to prefetch while ``layer`` runs forward."""
        if self.recording:
            return None
        if layer is self.outer:
            return self.order[0] if self.order else None
        i = layer.layer_idx
        return self.order[i + 1] if 0 <= i < len(self.order) - 1 and self.order[i] is layer else None

    def prev_of(self, layer: "Any") -> Optional["Any"]:
        """The layer to prefetch while ``layer`` runs backward."""
        if layer is self.outer:
            candidates = self.order[::-1]
        else:
            i = layer.layer_idx
            if not (0 <= i < len(self.order) and self.order[i] is layer):
                return None
            candidates = self.order[:i][::-1]
        for c in candidates:  # the closest earlier layer still waiting for its backward
            if c in self.active and not c.backward_finished:
                return c
        return None

    def keep_after_forward(self, layer: "Any") -> bool:
        """Stay gathered after a grad-enabled forward: backward starts with it."""
        if layer is self.outer:
            return True
        return not self.recording and bool(self.order) and self.order[-1] is layer

    def ran_with_grad(self, layer: "Any") -> None:
        """``layer`` ran with autograd: it has backward work this iteration."""
        if layer not in self.active:
            self.active.append(layer)

    # ----------------------------------------------------------- backward
    def grad_handed(self, nbytes: int) -> None:
        """A layer's full flat gradient (``nbytes``) was handed to the reduce-scatter."""
        self.pending_grad_bytes += nbytes
        self.peak_pending_grad_bytes = max(self.peak_pending_grad_bytes, self.pending_grad_bytes)

    def grad_reduced(self, nbytes: int) -> None:
        """That reduce-scatter completed: its full flat gradient is gone."""
        self.pending_grad_bytes -= nbytes

    def enter_backward(self) -> None:
        """Backward reached a layer: queue the end-of-backward callback once."""
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """End of backward: reduce what is left (layers whose parameters did not
        all get a gradient), complete every reduce-scatter, free everything."""
        with record_function("funcopt::zero3/end_backward"):
            try:
                for layer in self.active:  # forward order: the same on every rank
                    if not layer.backward_finished:
                        layer.finish_backward()
                self.bucketer.flush()
            finally:
                for layer in self.layers():
                    layer.reset_iteration()
                self.active = []
                self.in_backward = False
                self.pending_grad_bytes = 0  # what an error left in flight was dropped

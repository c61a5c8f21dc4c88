"""The step inside backward: each bucket of parameters steps as soon as its gradients exist.

A funcopt step is a function of an explicit gradient list in which ``None``
entries are skipped, and every algorithm's update of one parameter reads only
that parameter's gradient and state.  So the step of a bucket of parameters
can run the moment the last gradient of the bucket is accumulated, while
backward goes on through earlier layers; the gradients of that bucket are
then freed.  The numbers are those of backward-then-``step()``: the same
kernel runs over the same per-parameter tensors (bitwise, tested for every
algorithm of :data:`funcopt.REGISTRY`).

:class:`_Stepper` (shared with :func:`funcopt.distributed.ddp_step_hook`)
steps a subset of an optimizer's parameters through its public
``step(grads)`` and turns a user's own ``step()`` while a hook is installed
into a clear error (the step already happened).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import optimizer as _torch_optimizer
from torch.autograd.profiler import record_function

from . import registry
from .base import Optimizer

__all__ = ["StepInBackward", "step_in_backward"]


class _Stepper:
    """Steps chosen parameters of a funcopt optimizer with ``opt.step(grads)``.

    Refuses what would change the math when the step is split per bucket: an
    optimizer class that declares ``needs_all_grads`` (its update reads every
    gradient, e.g. clipping by the global norm), and step pre-hooks (torch's
    ``register_step_pre_hook``, per optimizer or global), which see the whole
    optimizer before a step and may transform every gradient.
    """

    def __init__(self, optimizer: Any, who: str):
        registry.refuse_out_of_scope(optimizer, who, also=" (funcopt.<Name>(...) instances)")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"{who} expects a funcopt optimizer (funcopt.Adam, funcopt.SGD, ...), got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}"
            )
        if getattr(optimizer, "_funcopt_in_backward", None) is not None:
            raise RuntimeError(
                f"{who}: this optimizer already steps inside backward ({optimizer._funcopt_in_backward}); "
                "remove that handle first"
            )
        self.opt = optimizer
        self.who = who
        self._local = threading.local()
        self.check_global()
        self._guard = optimizer.register_step_pre_hook(self._pre_hook)
        optimizer._funcopt_in_backward = who
        self._index: Dict[int, int] = {}
        self._n = -1
        self.reindex()

    def check_global(self) -> None:
        """Raise if a global-gradient transform is attached (checked at install and each backward)."""
        if getattr(self.opt, "needs_all_grads", False):
            raise ValueError(
                f"{self.who}: {type(self.opt).__name__} transforms all gradients together "
                "(needs_all_grads); stepping each bucket as its gradients arrive would change the "
                "result. Call backward() and then step()."
            )
        cls = type(self.opt)
        if getattr(cls, "group_state", ()) or getattr(cls, "phases", 1) != 1:
            raise ValueError(
                f"{self.who}: {cls.__name__} keeps per-group values that advance once per step (its step "
                "counter" + (", and a sum over every parameter" if getattr(cls, "phases", 1) != 1 else "")
                + "); a step per bucket inside backward would advance them once per bucket. Call backward() "
                "and then step()."
            )
        mine = getattr(self, "_guard", None)
        hooks = [k for k in getattr(self.opt, "_optimizer_step_pre_hooks", {})
                 if mine is None or k != mine.id]
        hooks += list(getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {}))
        if hooks:
            raise ValueError(
                f"{self.who}: the optimizer has step pre-hooks ({len(hooks)}); a pre-hook sees every "
                "gradient before the step (e.g. clipping by the global norm), which a step per bucket "
                "inside backward cannot honour. Remove them, or call backward() and then step()."
            )

    def reindex(self) -> bool:
        """Flat index of each parameter (groups in order); True when it changed."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        changed = index != self._index
        self._index, self._n, self.params = index, len(params), params
        return changed

    def position(self, p: Tensor) -> Optional[int]:
        return self._index.get(id(p))

    def step(self, idx: Sequence[int], grads: Sequence[Optional[Tensor]]) -> None:
        """``opt.step`` with ``grads`` at flat indices ``idx``, ``None`` elsewhere."""
        full: List[Optional[Tensor]] = [None] * self._n
        for i, g in zip(idx, grads):
            full[i] = g
        self._local.inside = True
        try:
            self.opt.step(full)
        finally:
            self._local.inside = False

    def _pre_hook(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not getattr(self._local, "inside", False):
            raise RuntimeError(
                f"funcopt: {type(opt).__name__}.step() called while {self.who} is installed: the step "
                "already ran inside backward (each bucket as its gradients arrived). Drop the step() "
                "call, or remove the handle (handle.remove()) to step after backward again."
            )

    def remove(self) -> None:
        self._guard.remove()
        if getattr(self.opt, "_funcopt_in_backward", None) == self.who:
            self.opt._funcopt_in_backward = None


class StepInBackward:
    """Handle returned by :func:`step_in_backward`.

    Attributes:
      buckets: the buckets, each a list of flat parameter indices (groups in order).
      held_grad_bytes: gradient bytes held right now (accumulated, not yet stepped).
      peak_grad_bytes: the most gradient bytes held at once since the last
        :meth:`reset_peak` (counted when a gradient is accumulated, before its
        bucket steps and frees it).
    """

    def __init__(self, optimizer: Any, bucket_mb: float):
        if not bucket_mb > 0:
            raise ValueError(f"step_in_backward: bucket_mb must be > 0, got {bucket_mb!r}")
        self._stepper = _Stepper(optimizer, "funcopt.step_in_backward")
        self.optimizer = optimizer
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self.buckets: List[List[int]] = []
        self._bucket_of: Dict[int, int] = {}
        self._hooks: Dict[int, Any] = {}
        self._pending: List[Dict[int, Tensor]] = []
        self._task = None  # graph task whose end callback is queued
        self._paused = False
        self.held_grad_bytes = 0
        self.peak_grad_bytes = 0
        self._holding: Dict[int, int] = {}
        self._removed = False
        self._build()

    # --------------------------------------------------------------- layout
    def _build(self) -> None:
        """Buckets in reverse parameter order (the order backward produces them)."""
        st = self._stepper
        st.reindex()
        self.buckets, self._bucket_of = [], {}
        cur: List[int] = []
        size = 0
        for i in reversed(range(len(st.params))):
            p = st.params[i]
            if not p.requires_grad:
                continue
            nbytes = p.numel() * p.element_size()
            if cur and size + nbytes > self.bucket_bytes:
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nbytes
        if cur:
            self.buckets.append(cur)
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        self._pending = [{} for _ in self.buckets]
        live = {id(st.params[i]) for members in self.buckets for i in members}
        for key in [k for k in self._hooks if k not in live]:
            self._hooks.pop(key).remove()
        for members in self.buckets:
            for i in members:
                p = st.params[i]
                if id(p) not in self._hooks:
                    self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    # ---------------------------------------------------------------- hooks
    def _on_grad(self, p: Tensor) -> None:
        if self._removed or self._paused:
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first gradient of this backward
            self._start(task)
        i = self._stepper.position(p)
        if i is None or i not in self._bucket_of:
            return
        if id(p) not in self._holding and p.grad is not None:
            n = p.grad.numel() * p.grad.element_size()
            self._holding[id(p)] = n
            self.held_grad_bytes += n
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.held_grad_bytes)
        b = self._bucket_of[i]
        self._pending[b][i] = p
        if len(self._pending[b]) == len(self.buckets[b]):
            self._step_bucket(b)

    def _start(self, task: int) -> None:
        st = self._stepper
        st.check_global()
        if st.reindex():  # add_param_group since the last backward
            self._build()
        # a backward that raised leaves nothing behind
        self._pending = [{} for _ in self.buckets]
        self._holding, self.held_grad_bytes = {}, 0
        self._task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        """End of backward: buckets with parameters that got no gradient step what they have."""
        self._task = None
        if self._removed or self._paused:
            return
        with record_function("funcopt::step_in_backward/flush"):
            # every gradient not stepped yet: buckets with a parameter that got none, and
            # parameters whose hook came too late (added by add_param_group since the last
            # backward) -- what backward-then-step() would step
            st = self._stepper
            for b in range(len(self.buckets)):
                self._pending[b] = {}
            late = [i for i, p in enumerate(st.params) if p.grad is not None and p.requires_grad]
            if late:
                self._run(late, [st.params[i] for i in late])

    def _step_bucket(self, b: int) -> None:
        pending = self._pending[b]
        self._pending[b] = {}
        idx = sorted(pending)
        with record_function("funcopt::step_in_backward/bucket_step"):
            self._run(idx, [pending[i] for i in idx])

    def _run(self, idx: List[int], params: List[Tensor]) -> None:
        self._stepper.step(idx, [p.grad for p in params])
        for p in params:  # free the gradients
            p.grad = None
            self.held_grad_bytes -= self._holding.pop(id(p), 0)

    # ------------------------------------------------------------------ api
    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Gradient accumulation: backward inside this context accumulates into
        ``.grad`` as usual and steps nothing; the next backward outside it
        steps on the sum (as backward, backward, ``step()`` would)."""
        self._paused, old = True, self._paused
        try:
            yield
        finally:
            self._paused = old

    def reset_peak(self) -> None:
        """Start measuring ``peak_grad_bytes`` again from the gradients held now."""
        self.peak_grad_bytes = self.held_grad_bytes

    def remove(self) -> None:
        """Remove every hook; ``optimizer.step()`` works as before."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self._stepper.remove()


def step_in_backward(optimizer: Any, bucket_mb: float = 25.0) -> StepInBackward:
    """Run ``optimizer``'s step inside backward, bucket by bucket, freeing the gradients.

    Each parameter gets a ``register_post_accumulate_grad_hook``; parameters
    are grouped in reverse order (the order backward produces their
    gradients) into buckets of at most ``bucket_mb`` MiB (a larger parameter
    is a bucket of its own).  When every gradient of a bucket is accumulated,
    the optimizer's step runs over that bucket (``optimizer.step(grads)`` with
    ``None`` for every other parameter: the same kernel, scripted if the
    optimizer is) and the bucket's ``.grad`` are set to ``None``.  At the end
    of backward, buckets with a parameter that got no gradient step the
    gradients they have.  Gradient memory held during backward is then about
    one bucket plus the largest parameter (``handle.peak_grad_bytes``).

    The result is bitwise that of ``loss.backward(); optimizer.step()``: every
    algorithm's update of a parameter reads only its own gradient and state.
    LR schedulers and other ``param_groups`` changes between backward calls
    apply as usual.  ``optimizer.step()`` while the handle is installed is an
    error (the step already ran).  Refused: an optimizer with step pre-hooks or
    ``needs_all_grads`` (a global-gradient transform such as clipping by the
    global norm would see one bucket at a time); AMP's ``GradScaler`` (its
    ``found_inf`` exists only after backward). Under DDP use
    :func:`funcopt.distributed.ddp_step_hook` (the step must wait for the
    all-reduce).

    Args:
      optimizer: a funcopt optimizer.
      bucket_mb: bucket size in MiB (default 25, as DDP's).

    Returns:
      a :class:`StepInBackward` handle: ``remove()``, ``no_step()`` (gradient
      accumulation), ``peak_grad_bytes``.

    Example::

        >>> import torch, funcopt
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> opt = funcopt.Adam(model.parameters(), lr=0.01)
        >>> handle = funcopt.step_in_backward(opt, bucket_mb=1)
        >>> model(torch.randn(8, 4)).pow(2).mean().backward()  # steps as it goes
        >>> all(p.grad is None for p in model.parameters())
        True
        >>> handle.remove()
    """
    return StepInBackward(optimizer, bucket_mb)

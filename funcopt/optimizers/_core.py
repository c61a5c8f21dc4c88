"""The step skeleton, written once, and the interface an algorithm implements.

An algorithm is a *kernel*: a small TorchScript-compatible class in its own
file (``funcopt/optimizers/<name>.py``) with four methods (:class:`Kernel`).
:class:`Core` -- the object ``funcopt.script`` compiles and the distributed
layers step -- does everything else, the same way for every algorithm:

* validation of the whole gradient list (and of ``grad_scale`` /
  ``found_inf``) before anything changes (:meth:`funcopt._slots.Slots.select`),
  then the kernel's own checks (:meth:`Kernel.check`);
* ``None`` gradients skipped; buckets (one group, device and dtype) stepped
  by one kernel call each;
* state allocated on a parameter's first gradient (:meth:`Kernel.init`), or
  for every parameter at construction (``init_at_construction``, Adagrad);
* AMP: on the foreach path a nonzero ``found_inf`` skips the step (one host
  read) and gradients are divided by ``grad_scale`` before the kernel sees
  them; a fused kernel gets both (0/1 flag, no host sync) and the step
  counters it bumped are put back on a skipped step;
* the step counters (the slot named ``step``) bumped once per step, with one
  op per bucket where they are views of one tensor;
* complex parameters stepped through real views (every complex tensor of the
  call, state included);
* with ``impl="auto"``, the foreach formula of a CPU bucket run cache-blocked
  (:meth:`Core._blocked`: once per ~``BLOCK_BYTES`` of parameters, bitwise
  the single call), elementwise rules only;
* tensors a fused kernel cannot take (strided, non-contiguous state) routed
  through the foreach formula, sparse COO gradients through the per-tensor
  formula (:meth:`Kernel.single`), ``differentiable=True`` through the
  per-tensor formula with autograd on (eager only).

TorchScript classes cannot inherit, so the core *holds* its kernel through a
``torch.jit.interface`` (made one on first scripting, :func:`ensure_interface`):
one compiled core type serves every algorithm.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .._slots import Slots
from ._common import bump, check_differentiable, found_inf_flag, real_views, skip_step, unscale

from typing import Dict  # noqa: E402  (TorchScript resolves annotations by name)

# The cache-blocked foreach fallback (Core._blocked): bytes of parameter
# elements per kernel call.  Read when a core is built (Core.block); tests
# patch it small.  Measured on one thread (docs/benchmarks.md,
# benchmarks/blocked_fallback.py --block-kib): 256 KiB loses to per-call
# overhead, 512 KiB-2 MiB are level; at 1 MiB a block's parameter, gradient,
# state and temporaries (5-8 MiB) stay in L3 from one op to the next.
BLOCK_BYTES = 1024 * 1024


class Kernel:
    """What one algorithm implements (a class with these methods, no base class).

    ``h`` is the parameter group's hyperparameters as floats (booleans 0/1,
    tuples as ``key0``, ``key1``..., ``None`` inside a tuple as NaN, strings
    through the optimizer class's ``hyper_codes``).  ``state`` holds one list
    per slot, in the optimizer class's ``slots`` order, aligned with
    ``params``; a slot absent for the group (its flag off) holds empty
    tensors.  The slot named ``step`` is bumped by the core before ``dense``
    and ``single`` run: kernels read it, never bump it.
    """

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        """Fresh state for ``p``: one tensor per slot (``torch.empty(0)`` for an
        absent slot).  Step counters: ``_common.step_tensor(p, fused)``."""
        pass

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        """Raise for input this algorithm refuses (before any change).
        ``params[idx[j]]`` has gradient ``grads[j]``; ``odd``: the list holds
        a sparse or strided gradient.  Most kernels: ``pass``."""
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        """The update rule over aligned lists of one device and dtype, in place.

        ``fused``: call the ATen fused kernel (only where the optimizer class
        lists the device in ``fused_devices``), passing ``grad_scale`` and
        ``found_inf`` (a 0.0/1.0 float32 tensor) on.  Otherwise the foreach
        formula, in torch's foreach order; ``grad_scale`` and ``found_inf``
        are then None (the core has unscaled and checked).  ``first``: every
        parameter is on its first step (only with ``split_first``).  Never
        write into ``grads``' tensors unless you made them (out-of-place ops).

        With ``impl="auto"`` a CPU bucket's foreach formula is called on
        blocks (:meth:`Core._blocked`): the lists may hold flat chunks of a
        parameter (and of its gradient and same-shaped state) with its other
        state whole, one chunk per call.  A rule that needs each parameter
        whole (a norm, a matrix product) declares the optimizer class's
        ``whole_params`` (Adafactor, Muon) and is always called on whole
        tensors."""
        pass

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        """torch's per-tensor formula: sparse COO gradients (only when the
        class's ``sparse_msg`` is empty) and ``differentiable=True`` (eager,
        autograd on; ``h["differentiable"]`` is 1.0).  Returns ``state``
        (new tensors where ``first`` created them)."""
        pass


class GroupRule:
    """What a rule with per-group state implements besides :class:`Kernel`
    (the optimizer class declares ``group_state``, ``phases = 2`` or train/eval
    modes; its kernel class implements both interfaces).  Other rules get
    :class:`NoGroups`.

    ``gs`` is one param group's values (float64 CPU vector, the class's
    ``group_state`` order): step counters and the like that the oracle keeps
    in ``param_groups``.  ``Kernel.dense`` and ``Kernel.single`` of such a
    class get one more ``state`` column after the slots, every entry of which
    is the group's ``gs`` (read ``state[len(state) - 1][0]``; written only in
    ``group``/``combine``/``mode``).
    """
    def group(self, groups: List[Tensor], hs: List[Dict[str, float]]) -> None:
        """Once per step, over every param group (``groups[g]`` its vector,
        ``hs[g]`` its hyperparameters) -- also groups without a gradient this
        step, as the oracles bump ``group['step']`` -- after the step's checks
        and before its buckets; not on a step AMP skips.  Updates the vectors
        in place; may raise, before it changes any of them."""
        pass

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        """Train/eval mode (Schedule-Free): once per param group, over every
        parameter of the group that has state (all devices and dtypes; maybe
        none), ``state`` as in ``dense`` with a group column of one entry.
        Swaps the parameters in place and records the mode in ``gs`` --
        nothing when the group is already in that mode."""
        pass

    def partial(self, groups: List[Tensor]) -> Tensor:
        """Two-phase rules (the class's ``phases = 2``, Prodigy): after every
        bucket's first-phase ``dense``, the sums to add up over all parameters
        -- across ranks too (ZeRO, RPC) -- as one float64 vector."""
        pass

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        """Two-phase rules: ``total`` is :meth:`partial` summed over every
        rank; update every group's ``gs`` (e.g. Prodigy's ``d``) before the
        second-phase ``dense`` calls."""
        pass



class NoGroups:
    """The :class:`GroupRule` of a rule without per-group state."""

    def __init__(self) -> None:
        self.name = "none"

    def group(self, groups: List[Tensor], hs: List[Dict[str, float]]) -> None:
        pass

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        pass

    def partial(self, groups: List[Tensor]) -> Tensor:
        return torch.empty(0, dtype=torch.float64)

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        pass


class StepCounter:
    """The :class:`GroupRule` of a one-pass rule whose only group state is the oracle's
    ``group['step']`` (``group_state = (("step", 0),)``; ADOPT, AdEMAMix, SOAP): bumps it
    once per step, in every param group (the oracle's, with or without gradients).  The
    optimizer class names it in ``group_rule_class``; its kernel then implements
    :class:`Kernel` alone."""

    def __init__(self) -> None:
        self.name = "step"

    def group(self, groups: List[Tensor], hs: List[Dict[str, float]]) -> None:
        for gs in groups:  # group['step'] += 1
            gs[0].add_(1.0)

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        pass

    def partial(self, groups: List[Tensor]) -> Tensor:
        return torch.empty(0, dtype=torch.float64)  # one pass: no sums across parameters

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        pass


def ensure_interface() -> None:
    """Make :class:`Kernel` a ``torch.jit.interface`` (once, quietly), right
    before the first scripting: not at import time, where torch >= 2.14 would
    print its TorchScript deprecation notice to every user of funcopt."""
    if not getattr(Kernel, "__torch_script_interface__", False):
        from ..script import quiet_jit

        with quiet_jit():
            torch.jit.interface(Kernel)
            torch.jit.interface(GroupRule)


def native_bucket(p: Tensor) -> bool:
    """Whether a fast bucket of ``p``'s device and dtype runs the native rule
    (funcopt.native.NATIVE_DTYPES on CPU), not an ATen fused kernel."""
    return p.is_cpu and (p.dtype == torch.float32 or p.dtype == torch.float64)


class NativeKernel:
    """An algorithm's kernel with its native one-pass rule on the fast path.

    Holds the algorithm's own kernel (``base``) for everything but the fast
    path: state, checks, the foreach formula (strided tensors, other dtypes
    and devices) and the per-tensor formula.  On a bucket flagged fast
    (``fused``: CPU, float32/float64, contiguous) it calls
    ``torch.ops.funcopt.step_`` (:mod:`funcopt.native`) with the state slots
    flattened slot-major and the hyperparameters named by ``keys``, in the
    order the C++ rule reads them (the key ``first``: 1.0 on a call of
    first steps, for ``split_first`` classes).  The core gives it unscaled,
    checked gradients (:meth:`Core._apply`).  A fast bucket the rule does not
    take (an algorithm that also has an ATen fused kernel, SGD: other devices
    and dtypes) goes to the base kernel's fused path, with ``grad_scale`` and
    ``found_inf``.
    """

    def __init__(self, base: Kernel, rule: str, keys: List[str]) -> None:
        self.base = base
        self.rule = rule
        self.keys = keys
        self.name = rule

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return self.base.init(p, fused, h)

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        self.base.check(params, idx, grads, h, odd)

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        if not fused or not native_bucket(params[0]):
            self.base.dense(params, grads, state, h, fused, first, grad_scale, found_inf)
            return
        flat: List[Tensor] = []
        for col in state:
            flat.extend(col)
        hyper: List[float] = []
        for k in self.keys:
            if k == "first":
                hyper.append(1.0 if first else 0.0)
            else:
                hyper.append(h[k])
        torch.ops.funcopt.step_(self.rule, params, grads, flat, hyper, grad_scale, found_inf)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        return self.base.single(params, grads, state, h, first)


class Core:
    """Scriptable state and step of one optimizer: a :class:`Slots` and a kernel."""

    def __init__(self, slots: Slots, kernel: Kernel, sparse_msg: str, split_first: bool,
                 init_at_construction: bool, rule: GroupRule, fused_amp: bool = True, block: int = 0,
                 native: bool = False, grouped: bool = False, phases: int = 1):
        self.slots = slots
        self.kernel = kernel
        self.rule = rule  # the kernel itself for a rule with per-group state, else NoGroups()
        # the class keeps per-group values (``group_state``): the kernel's ``group`` runs once
        # per group per step, and its ``dense``/``single`` get the group's vector as a last
        # state column
        self.grouped = grouped
        # 2: a rule with a sum over all parameters between two passes (Prodigy's ``d``):
        # ``begin`` (first pass), ``rule.partial`` summed over ranks, ``finish`` (second pass)
        self.phases = phases
        self.bumping = True  # False during a second pass: the step counters moved in the first
        self.pending_idx: List[List[int]] = []
        self.pending_grads: List[List[Tensor]] = []
        self.pending_odd: List[bool] = []
        self.pending_skip = False
        self.pending_scale = torch.jit.annotate(Optional[Tensor], None)
        # > 0: run the foreach formula of a CPU bucket cache-blocked (:meth:`_blocked`), about
        # this many bytes of parameter elements per kernel call; 0: one call per bucket.  Set
        # (funcopt.base, BLOCK_BYTES) for impl="auto" and an elementwise rule only: impl="foreach"
        # stays torch's call sequence, a whole-parameter rule (Adafactor, Muon) cannot be cut.
        self.block = block
        # False: the bucket's fast path (a native rule) gets unscaled, checked
        # gradients like the foreach path; True: an ATen fused kernel takes
        # grad_scale / found_inf itself -- except, with ``native`` (the kernel is a
        # NativeKernel), on the buckets its rule steps (native_bucket: SGD's float32
        # and float64 CPU buckets)
        self.fused_amp = fused_amp
        self.native = native
        self.sparse_msg = sparse_msg
        self.split_first = split_first
        if init_at_construction:
            for b in range(len(slots.buckets)):
                h = slots.hp(b)
                for i in slots.buckets[b]:
                    if not slots.has_state[i]:
                        with torch.no_grad():
                            slots.init(i, kernel.init(slots.params[i], slots.bucket_fused[b], h))

    def step(
        self,
        grads: List[Optional[Tensor]],
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
    ) -> None:
        s = self.slots
        # every check first, then changes
        idx, gs, odd = s.select(grads, grad_scale, found_inf, self.sparse_msg)
        self._check(idx, gs, odd)
        found_inf = found_inf_flag(found_inf)
        if self.phases == 2:  # as begin(): a skipped step ends here, the passes see no flag
            if skip_step(found_inf):
                s.release()
                return
            found_inf = None
        # one loop over the passes, not begin() + finish(): the scripted step's graph holds the
        # bucket loop once (TorchScript inlines every method call; the profiling executor's
        # first calls cost in proportion to the graph, for every rule)
        for phase in range(self.phases):
            if phase == 0:
                self.bumping = True
                if self.grouped:
                    self._groups(found_inf)
            else:  # a two-phase rule in one process: the first pass's sums are the totals
                self.rule.combine(s.groups, self.rule.partial(s.groups))
                self.bumping = False
            self._buckets(idx, gs, odd, grad_scale, found_inf)
        self.bumping = True
        s.release()

    def begin(
        self,
        grads: List[Optional[Tensor]],
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
    ) -> None:
        """A two-phase rule's first pass (checks, group hooks, every bucket's
        first-phase ``dense``); then ``rule.partial`` (summed over ranks)
        goes to :meth:`finish`."""
        s = self.slots
        self.bumping = True
        idx, gs, odd = s.select(grads, grad_scale, found_inf, self.sparse_msg)
        self._check(idx, gs, odd)
        found_inf = found_inf_flag(found_inf)
        self.pending_skip = skip_step(found_inf)
        self.pending_idx = idx
        self.pending_grads = gs
        self.pending_odd = odd
        self.pending_scale = grad_scale
        if self.pending_skip:
            return
        self._groups(None)
        self._buckets(idx, gs, odd, grad_scale, None)
        s.release()

    def partials(self) -> Tensor:
        """The first pass's partial sums (``rule.partial``), to add up across ranks."""
        return self.rule.partial(self.slots.groups)

    def finish(self, total: Tensor) -> None:
        """A two-phase rule's second pass over the gradients :meth:`begin` took."""
        idx = self.pending_idx
        gs = self.pending_grads
        self.pending_idx = torch.jit.annotate(List[List[int]], [])
        self.pending_grads = torch.jit.annotate(List[List[Tensor]], [])
        if self.pending_skip:
            return
        self.rule.combine(self.slots.groups, total)
        self.bumping = False  # (begin sets it back: TorchScript has no try/finally)
        self._buckets(idx, gs, self.pending_odd, self.pending_scale, None)
        self.bumping = True
        self.pending_scale = None
        self.slots.release()

    def set_mode(self, train: bool) -> None:
        """Train (``True``) or eval mode of a rule that has both (Schedule-Free):
        the kernel's ``mode`` once per param group, over its parameters with state."""
        s = self.slots
        for g in range(len(s.hyper)):
            params: List[Tensor] = []
            state: List[List[Tensor]] = []
            for _k in range(s.num_slots):
                state.append(torch.jit.annotate(List[Tensor], []))
            for i in range(len(s.params)):
                if s.group_of[i] == g and s.has_state[i]:
                    params.append(s.params[i])
                    for k in range(s.num_slots):
                        state[k].append(s.state[k][i])
            state.append([s.groups[g]])
            s.keep(params)
            for col in state:
                s.keep(col)
            with torch.no_grad():
                self.rule.mode(params, state, s.hyper[g], train)
        s.release()

    def _check(self, idx: List[List[int]], gs: List[List[Tensor]], odd: List[bool]) -> None:
        s = self.slots
        for b in range(len(idx)):
            if len(idx[b]) == 0:
                continue
            h = s.hp(b)
            if h.get("differentiable", 0.0) != 0.0:
                check_differentiable(s.params, idx[b])
            self.kernel.check(s.params, idx[b], gs[b], h, odd[b])

    def _groups(self, found_inf: Optional[Tensor]) -> None:
        """The rule's ``group`` over every param group (not on a skipped step)."""
        if skip_step(found_inf):
            return
        s = self.slots
        self.rule.group(s.groups, s.hyper)

    def _group_column(self, b: int, n: int) -> List[Tensor]:
        gv = self.slots.groups[self.slots.group_of[self.slots.buckets[b][0]]]
        return [gv for _ in range(n)]

    def _buckets(self, idx: List[List[int]], gs: List[List[Tensor]], odd: List[bool],
                 grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        s = self.slots
        for b in range(len(idx)):
            if len(idx[b]) == 0:
                continue
            h = s.hp(b)
            fused = s.bucket_fused[b]
            if h.get("differentiable", 0.0) != 0.0:
                if not torch.jit.is_scripting():
                    self._differentiable(b, idx[b], gs[b], h, grad_scale, found_inf)
                continue
            with torch.no_grad():
                if odd[b]:
                    fi, fg, si, sg, pi, pg = s.partition(b, idx[b], gs[b])
                    self._dense(b, fi, fg, fused, h, grad_scale, found_inf)
                    self._dense(b, si, sg, False, h, grad_scale, found_inf)
                    self._single(b, pi, pg, h, grad_scale, found_inf)
                else:
                    self._dense(b, idx[b], gs[b], fused, h, grad_scale, found_inf)

    def _dense(self, b: int, idx: List[int], grads: List[Tensor], fused: bool, h: Dict[str, float],
               grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        if len(idx) == 0:
            return
        s = self.slots
        new = s.missing(b, idx)
        if len(new) == 0:
            self._apply(b, idx, grads, fused, False, h, grad_scale, found_inf)
            return
        if not self.split_first:
            for i in new:
                s.init(i, self.kernel.init(s.params[i], fused, h))
            self._apply(b, idx, grads, fused, False, h, grad_scale, found_inf)
            return
        # first steps apart (e.g. SGD's buffer starts as the gradient); a
        # skipped first step leaves no state behind (one host read, first steps only)
        if skip_step(found_inf):
            return
        gnew: List[Tensor] = []
        old: List[int] = []
        gold: List[Tensor] = []
        for j in range(len(idx)):
            i = idx[j]
            if i in new:
                gnew.append(grads[j])
            else:
                old.append(i)
                gold.append(grads[j])
        for i in new:
            s.init(i, self.kernel.init(s.params[i], fused, h))
        self._apply(b, new, gnew, fused, True, h, grad_scale, found_inf)
        self._apply(b, old, gold, fused, False, h, grad_scale, found_inf)

    def _apply(self, b: int, idx: List[int], grads: List[Tensor], fused: bool, first: bool,
               h: Dict[str, float], grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        if len(idx) == 0:
            return
        s = self.slots
        aten_amp = fused and self.fused_amp and not (self.native and native_bucket(grads[0]))
        if not aten_amp:
            if skip_step(found_inf):
                return
            grads = unscale(grads, grad_scale)
            grad_scale = None
            found_inf = None
        L = s.lists(b, idx)
        params = L[0]
        state: List[List[Tensor]] = []
        for k in range(s.num_slots):
            state.append(L[k + 1])
        if s.step_slot >= 0 and self.bumping:
            bump(state[s.step_slot], s.step_base(b, idx))
        if self.grouped:
            state.append(self._group_column(b, len(params)))
        if params[0].is_complex():  # one dtype per bucket; never fused
            params = s.keep(real_views(params))
            grads = real_views(grads)
            for k in range(len(state)):
                col = state[k]
                if len(col) > 0 and col[0].is_complex():
                    state[k] = s.keep(real_views(col))
        if self.block > 0 and not fused and params[0].is_cpu and not torch.compiler.is_compiling():
            self._blocked(params, grads, state, h, first)
        else:
            self.kernel.dense(params, grads, state, h, fused, first, grad_scale, found_inf)
        if aten_amp and found_inf is not None and s.step_slot >= 0:
            # found_inf is 0.0 or 1.0 (found_inf_flag): undo the bump on a skipped step
            steps = state[s.step_slot]
            torch._foreach_sub_(steps, [found_inf for _ in steps])

    def _blocked(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                 h: Dict[str, float], first: bool) -> None:
        """The foreach formula over cache-sized blocks (CPU, elementwise rules).

        A foreach chain is op-major: each op streams the whole list through
        memory, so on a large model every op pays DRAM bandwidth.  Here the
        kernel's ``dense`` runs once per block of about ``self.block`` bytes
        of parameter elements, whose parameters, gradients, state and
        temporaries stay in cache from one op to the next.  Bitwise the
        single call: the rules are elementwise, each tensor's per-tensor
        scalars come from its own step counter (passed whole to each of its
        chunks), and foreach ops treat list entries independently.

        * tensors smaller than a block are grouped, whole, into blocks;
        * a larger one whose parameter, gradient and same-shaped state are
          contiguous is cut into flat views (``view(-1)``, bounds at
          multiples of 64 elements: whole aligned vectors for float32 and
          float64), one kernel call each; its other state (0-d: step counters, NAdam's ``mu_product``, ASGD's
          ``eta``/``mu``) goes whole to every chunk's call, and what of it
          the rule may write (every such slot but the step counters, which
          kernels only read) is snapshot before the first call and restored
          before each later one: every call starts from the step's value,
          the last leaves the updated one;
        * a larger one that cannot be cut (strided, state of another shape)
          is a block by itself.
        """
        s = self.slots
        limit = self.block // params[0].element_size()
        align = 64
        total = 0
        for p in params:
            total += p.numel()
        if total <= limit or limit < align:
            self.kernel.dense(params, grads, state, h, False, first, None, None)
            return
        nk = len(state)
        bp: List[Tensor] = []
        bg: List[Tensor] = []
        bs: List[List[Tensor]] = []
        for _k in range(nk):
            bs.append(torch.jit.annotate(List[Tensor], []))
        used = 0
        for j in range(len(params)):
            p = params[j]
            m = p.numel()
            pieces = 1
            size = m
            if m > limit and self._cuttable(p, grads[j], state, j):
                pieces = (m + limit - 1) // limit
                size = (m + pieces - 1) // pieces
                size = (size + align - 1) // align * align
                pieces = (m + size - 1) // size
            if pieces == 1:
                if used + m > limit and len(bp) > 0:
                    self._block_call(bp, bg, bs, h, first)
                    bp = []
                    bg = []
                    bs = []
                    for _k in range(nk):
                        bs.append(torch.jit.annotate(List[Tensor], []))
                    used = 0
                bp.append(p)
                bg.append(grads[j])
                for k in range(nk):
                    bs[k].append(state[k][j])
                used += m
                continue
            pc = p.view(-1).split(size)
            gc = grads[j].view(-1).split(size)
            cols: List[List[Tensor]] = []
            saved: List[Tensor] = []
            snaps: List[Tensor] = []
            for k in range(nk):
                t = state[k][j]
                if t.size() == p.size() and k < s.num_slots:
                    cols.append(t.view(-1).split(size))
                else:
                    cols.append([t for _ in range(pieces)])
                    if k != s.step_slot and t.numel() > 0 and k < s.num_slots:
                        saved.append(t)
                        snaps.append(t.clone())
            for c in range(pieces):
                if c > 0:
                    for r in range(len(saved)):
                        saved[r].copy_(snaps[r])
                cs: List[List[Tensor]] = []
                for k in range(nk):
                    cs.append([cols[k][c]])
                self._block_call([pc[c]], [gc[c]], cs, h, first)
        if len(bp) > 0:
            self._block_call(bp, bg, bs, h, first)

    def _cuttable(self, p: Tensor, g: Tensor, state: List[List[Tensor]], j: int) -> bool:
        """Whether parameter ``j`` can be cut into flat chunks: it, its gradient
        and its state shaped like it contiguous; other state 0-d or empty."""
        if not p.is_contiguous() or not g.is_contiguous():
            return False
        for k in range(self.slots.num_slots):  # not the group column (read whole by every chunk)
            t = state[k][j]
            if t.size() == p.size():
                if not t.is_contiguous():
                    return False
            elif t.numel() > 1 or (t.numel() == 1 and t.dim() > 0):
                return False
        return True

    def _block_call(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                    h: Dict[str, float], first: bool) -> None:
        s = self.slots
        s.keep(params)
        for col in state:
            s.keep(col)
        self.kernel.dense(params, grads, state, h, False, first, None, None)

    def _single(self, b: int, idx: List[int], grads: List[Tensor], h: Dict[str, float],
                grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        """Per tensor: sparse COO gradients (and, eagerly, differentiable=True)."""
        if len(idx) == 0 or skip_step(found_inf):
            return
        s = self.slots
        gl: List[Tensor] = []
        for g in grads:
            gl.append(g if grad_scale is None else g / grad_scale.reshape([]))
        if not self.split_first:
            for i in s.missing(b, idx):
                s.init(i, self.kernel.init(s.params[i], False, h))
            self._single_call(idx, gl, h, False)
            return
        had = [s.has_state[i] for i in idx]
        for first in [True, False]:
            sub: List[int] = []
            gsub: List[Tensor] = []
            for j in range(len(idx)):
                if had[j] != first:
                    sub.append(idx[j])
                    gsub.append(gl[j])
            if len(sub) > 0:
                self._single_call(sub, gsub, h, first)

    def _single_call(self, idx: List[int], grads: List[Tensor], h: Dict[str, float], first: bool) -> None:
        s = self.slots
        params: List[Tensor] = [s.params[i] for i in idx]
        state: List[List[Tensor]] = []
        for k in range(s.num_slots):
            col = s.state[k]
            state.append(s.keep([col[i] if not first else torch.empty(0) for i in idx]))
        if s.step_slot >= 0 and not first and self.bumping:
            bump(state[s.step_slot])
        if self.grouped:
            gv = s.groups[s.group_of[idx[0]]]
            state.append(s.keep([gv for _ in idx]))
        out = self.kernel.single(params, grads, state, h, first)
        if first:
            for j in range(len(idx)):
                s.init(idx[j], [out[k][j] for k in range(s.num_slots)])

    @torch.jit.unused
    def _differentiable(self, b: int, idx: List[int], grads: List[Tensor], h: Dict[str, float],
                        grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        with torch.enable_grad():
            self._single(b, idx, grads, h, grad_scale, found_inf)

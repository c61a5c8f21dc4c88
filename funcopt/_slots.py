"""Scriptable per-parameter state storage shared by every funcopt algorithm.

TorchScript classes cannot inherit, so every algorithm core *holds* a
:class:`Slots` (composition) and writes only its own ``step``.  ``Slots`` owns
what all algorithms have in common:

* the flat parameter list, the param-group each parameter belongs to, and the
  "buckets" (runs of parameters of one group sharing device and dtype, so a
  fused or foreach kernel may take them in one call);
* per-group hyperparameters as ``Dict[str, float]`` (booleans as 0.0 / 1.0),
  which the Python wrapper keeps in sync with ``param_groups``;
* one list of state tensors per named slot (``state[slot][param]``), filled
  lazily on a parameter's first gradient, like ``torch.optim``;
* validation of a gradient list (and of ``grad_scale`` / ``found_inf``), done
  for the whole list before any tensor is touched;
* per step, which gradients the bucket's kernel may take: torch's fused CPU
  kernels walk memory linearly, so in a fused bucket a parameter, gradient or
  state tensor that is not contiguous (channels_last, transposed, expanded,
  a slice) goes through the foreach formula for that step (``partition``), a
  non-contiguous gradient of a contiguous parameter is copied contiguous, and
  sparse COO gradients go to the algorithm's per-tensor formula.  Checked
  every step (``p.data = ...`` can change strides after construction); the
  all-contiguous case costs two ``is_contiguous`` reads per gradient;
* the step counters of a full bucket as views of one tensor (``step_base``),
  so a step bumps them with one op instead of one ``add_`` per parameter (on
  the CPU, ``_foreach_add_`` is a loop of ``add_`` calls).  They are re-homed
  into a fresh tensor (values kept) whenever the bucket's cached lists are
  rebuilt, so loading or replacing state needs nothing special.

Note on TorchScript (torch 2.13): an in-place ``torch._foreach_*`` or
``torch._fused_*_`` op whose mutated list was freshly built in the method is
removed as dead code by the script compiler (its schema marks the *list*, not
the tensors in it, as written).  Every list a kernel mutates is therefore
either a persistent attribute (the cached full-bucket lists) or registered in
``self.live`` for the duration of the step, which makes the writes
observable.  Tests compare every scripted path with eager by value.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


class Slots:
    def __init__(
        self,
        params: List[Tensor],
        group_of: List[int],
        buckets: List[List[int]],
        bucket_fused: List[bool],
        hyper: List[Dict[str, float]],
        num_slots: int,
        step_slot: int = -1,
    ):
        self.params = params
        self.group_of = group_of
        self.buckets = buckets
        self.bucket_fused = bucket_fused
        self.hyper = hyper
        self.num_slots = num_slots
        self.has_state: List[bool] = [False for _ in params]
        empty: List[List[Tensor]] = []
        for _k in range(num_slots):
            empty.append([torch.empty(0) for _ in params])
        self.state = empty
        # per bucket: [params, slot0, slot1, ...] over the whole bucket, valid
        # once every parameter of the bucket has state (bucket_ready).
        self.full: List[List[List[Tensor]]] = [
            torch.jit.annotate(List[List[Tensor]], []) for _ in buckets
        ]
        self.bucket_ready: List[bool] = [False for _ in buckets]
        self.live: List[List[Tensor]] = []
        # the slot holding per-parameter step counters (-1: none), and per
        # bucket the tensor whose elements they are (empty: not homed)
        self.step_slot = step_slot
        self.step_bases: List[Tensor] = [torch.empty(0) for _ in buckets]
        bucket_of: List[int] = [0 for _ in params]
        for b in range(len(buckets)):
            for i in buckets[b]:
                bucket_of[i] = b
        self.bucket_index = bucket_of
        # per bucket: every state tensor is contiguous (else select() sends the
        # bucket through partition(); a fused kernel needs contiguous state)
        self.bucket_dense: List[bool] = [True for _ in buckets]
        # bumped whenever a state tensor is replaced (allocation, set_state,
        # re-homed step counters): the Python wrapper re-reads its state view
        self.epoch = 0
        # per param group: the values the rule keeps per group (the optimizer class's
        # ``group_state``: step counters and the like, in the oracle's param_groups), one
        # float64 CPU vector each, updated in place by the kernel's ``group`` (empty: none)
        self.groups: List[Tensor] = [torch.empty(0, dtype=torch.float64) for _ in hyper]

    def _bad_grad(self, i: int, g: Tensor) -> str:
        p = self.params[i]
        if g.shape != p.shape:
            return "funcopt: gradient " + str(i) + " has shape " + str(g.shape) + " but its parameter has shape " + str(p.shape)
        if g.dtype != p.dtype:
            return "funcopt: gradient " + str(i) + " has dtype " + str(g.dtype) + " but its parameter has dtype " + str(p.dtype)
        if g.device != p.device:
            return "funcopt: gradient " + str(i) + " is on " + str(g.device) + " but its parameter is on " + str(p.device)
        return ""

    def _odd(self, i: int, g: Tensor, sparse_msg: str) -> None:
        """A gradient that failed the cheap test in :meth:`select`: raise if it
        is invalid (else it needs the slow path)."""
        if g.layout == torch.strided or g.layout == torch.sparse_coo:
            msg = self._bad_grad(i, g)
            if msg != "":
                raise ValueError(msg)
        if g.layout == torch.strided:
            return  # not contiguous (or its parameter is not), in a fused bucket
        if sparse_msg != "":
            raise RuntimeError(sparse_msg)
        if g.layout != torch.sparse_coo:
            raise RuntimeError(
                "funcopt: gradient " + str(i) + " is a sparse tensor of a layout other than COO "
                "(e.g. CSR); only dense and sparse COO gradients are supported"
            )

    def _amp_arg(self, name: str, t: Tensor) -> None:
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(
                "funcopt: " + name + " must be a float32 tensor with one element (as torch.amp.GradScaler "
                "makes it), got dtype " + str(t.dtype) + " and shape " + str(t.shape)
            )

    def select(
        self,
        grads: List[Optional[Tensor]],
        grad_scale: Optional[Tensor] = None,
        found_inf: Optional[Tensor] = None,
        sparse_msg: str = "",
    ) -> Tuple[List[List[int]], List[List[Tensor]], List[bool]]:
        """Validate ``grads`` (and ``grad_scale`` / ``found_inf``) and split the
        non-None gradients by bucket.

        Returns, per bucket, the parameter indices that have a gradient, the
        gradients themselves, and whether the bucket needs :meth:`partition`
        (a sparse COO gradient; in a fused bucket, a parameter, gradient or
        state tensor that is not contiguous: torch's fused kernels walk
        memory linearly).  ``sparse_msg``: the error for a sparse gradient
        ("" = sparse COO gradients are accepted).  Raises before anything is
        modified: ``ValueError`` for a gradient of the wrong shape, dtype or
        device and for a bad ``grad_scale`` / ``found_inf``; ``RuntimeError``
        (as torch.optim) for refused sparse gradients and integer parameters.
        """
        n = len(self.params)
        if len(grads) != n:
            raise ValueError(
                "funcopt: step() got "
                + str(len(grads))
                + " gradients for "
                + str(n)
                + " parameters"
            )
        if grad_scale is not None:
            self._amp_arg("grad_scale", grad_scale)
        if found_inf is not None:
            self._amp_arg("found_inf", found_inf)
        params = self.params
        idx: List[List[int]] = []
        gs: List[List[Tensor]] = []
        odd: List[bool] = []
        for b in range(len(self.buckets)):
            bucket = self.buckets[b]
            bg: List[Tensor] = []
            rare: List[int] = []  # gradients that failed the cheap test (no loop-carried flag: cheaper)
            # one cheap test per gradient; the message is worked out only when
            # it fails.  TorchScript: is_same_size builds no size lists (2x
            # cheaper); Dynamo cannot trace it, but shapes are static there.
            # dtype and device are compared with the bucket's (one dtype and
            # device per bucket), saving two reads per gradient.
            p0 = params[bucket[0]]
            dt = p0.dtype
            dev = p0.device
            if self.bucket_fused[b]:
                for i in bucket:
                    g = grads[i]
                    if g is not None:
                        p = params[i]
                        if torch.jit.is_scripting():
                            same = torch.is_same_size(g, p)
                        else:
                            same = g.shape == p.shape
                        if (not same or g.dtype != dt or g.device != dev or g.layout != torch.strided
                                or not g.is_contiguous() or not p.is_contiguous()):
                            self._odd(i, g, sparse_msg)
                            rare.append(i)
                        bg.append(g)
                if not self.bucket_dense[b]:
                    rare.append(-1)
            else:
                for i in bucket:
                    g = grads[i]
                    if g is not None:
                        p = params[i]
                        if torch.jit.is_scripting():
                            same = torch.is_same_size(g, p)
                        else:
                            same = g.shape == p.shape
                        if not same or g.dtype != dt or g.device != dev or g.layout != torch.strided:
                            self._odd(i, g, sparse_msg)
                            rare.append(i)
                        bg.append(g)
            # every gradient present (the common case): the bucket's own list,
            # which no caller modifies
            bi = bucket
            if len(bg) != len(bucket):
                bi = []
                for i in bucket:
                    if grads[i] is not None:
                        bi.append(i)
            slow = len(rare) > 0
            if len(bi) > 0:
                p0 = params[bi[0]]
                if not p0.is_floating_point() and not p0.is_complex():
                    raise RuntimeError(
                        "funcopt: parameter " + str(bi[0]) + " has dtype " + str(p0.dtype)
                        + "; optimizers update floating point or complex parameters only"
                    )
                if grad_scale is not None and grad_scale.device != p0.device:
                    raise ValueError("funcopt: grad_scale is on " + str(grad_scale.device)
                                     + " but parameters are on " + str(p0.device))
                if found_inf is not None and found_inf.device != p0.device:
                    raise ValueError("funcopt: found_inf is on " + str(found_inf.device)
                                     + " but parameters are on " + str(p0.device))
            idx.append(bi)
            gs.append(bg)
            odd.append(slow and len(bi) > 0)
        return idx, gs, odd

    def partition(
        self, b: int, idx: List[int], grads: List[Tensor]
    ) -> Tuple[List[int], List[Tensor], List[int], List[Tensor], List[int], List[Tensor]]:
        """Split a bucket flagged by :meth:`select` into (the fast path: the
        bucket's kernel), (strided tensors a fused kernel cannot take: the
        foreach formula) and (sparse COO gradients: the per-tensor formula).

        Fast gradients are made contiguous where their parameter is (a copy,
        only for such gradients).  Changes nothing.
        """
        fused = self.bucket_fused[b]
        fi: List[int] = []
        fg: List[Tensor] = []
        si: List[int] = []
        sg: List[Tensor] = []
        pi: List[int] = []
        pg: List[Tensor] = []
        for j in range(len(idx)):
            i = idx[j]
            g = grads[j]
            if g.layout != torch.strided:
                pi.append(i)
                pg.append(g)
            elif not fused:
                fi.append(i)
                fg.append(g)
            else:
                ok = self.params[i].is_contiguous()
                if ok and self.has_state[i]:
                    for k in range(self.num_slots):
                        ok = ok and self.state[k][i].is_contiguous()
                if ok:
                    fi.append(i)
                    fg.append(g if g.is_contiguous() else g.contiguous())
                else:
                    si.append(i)
                    sg.append(g)
        return fi, fg, si, sg, pi, pg

    def hp(self, b: int) -> Dict[str, float]:
        return self.hyper[self.group_of[self.buckets[b][0]]]

    def missing(self, b: int, idx: List[int]) -> List[int]:
        """Indices in ``idx`` whose state is not allocated yet."""
        out: List[int] = []
        if not self.bucket_ready[b]:
            for i in idx:
                if not self.has_state[i]:
                    out.append(i)
        return out

    def init(self, i: int, values: List[Tensor]) -> None:
        for k in range(self.num_slots):
            self.state[k][i] = values[k]
        self._note_layout(i, values)
        self.has_state[i] = True
        self.bucket_ready[self.bucket_index[i]] = False
        self.epoch += 1

    def _note_layout(self, i: int, values: List[Tensor]) -> None:
        for v in values:
            if v.layout != torch.strided or not v.is_contiguous():
                self.bucket_dense[self.bucket_index[i]] = False

    def lists(self, b: int, idx: List[int]) -> List[List[Tensor]]:
        """``[params, slot0, slot1, ...]`` restricted to ``idx`` (all with state)."""
        if len(idx) == len(self.buckets[b]):
            if not self.bucket_ready[b]:
                ready = True
                for i in idx:
                    ready = ready and self.has_state[i]
                if ready:
                    self._home_steps(b, idx)
                    self.full[b] = self.gather(idx)
                    self.bucket_ready[b] = True
            if self.bucket_ready[b]:
                return self.full[b]
        out = self.gather(idx)
        for lst in out:
            self.live.append(lst)
        return out

    def _home_steps(self, b: int, idx: List[int]) -> None:
        """Make the step counters of bucket ``b`` (all of it, ``idx``) views of
        one new tensor, values kept.  Not under torch.compile (aliased mutated
        inputs) and not for counters of mixed dtype or device."""
        self.step_bases[b] = torch.empty(0)
        if self.step_slot < 0 or len(idx) < 2 or torch.compiler.is_compiling():
            return
        col = self.state[self.step_slot]
        first = col[idx[0]]
        counters: List[Tensor] = []
        for i in idx:
            c = col[i]
            if c.dim() != 0 or c.dtype != first.dtype or c.device != first.device:
                return
            counters.append(c)
        base = torch.stack(counters)
        self.epoch += 1
        for j in range(len(idx)):
            col[idx[j]] = base[j]
        self.step_bases[b] = base

    def step_base(self, b: int, idx: List[int]) -> Optional[Tensor]:
        """The tensor whose elements are the step counters in ``lists(b, idx)``
        (call after ``lists``), or None: bump them one by one."""
        base = self.step_bases[b]
        if base.numel() > 0 and self.bucket_ready[b] and len(idx) == len(self.buckets[b]):
            return base
        return None

    def gather(self, idx: List[int]) -> List[List[Tensor]]:
        out: List[List[Tensor]] = [[self.params[i] for i in idx]]
        for k in range(self.num_slots):
            col = self.state[k]
            out.append([col[i] for i in idx])
        return out

    def keep(self, lst: List[Tensor]) -> List[Tensor]:
        """Register a freshly built list that a kernel mutates (see module doc)."""
        self.live.append(lst)
        return lst

    def release(self) -> None:
        self.live = torch.jit.annotate(List[List[Tensor]], [])

    # --- accessors used by the Python wrapper (state_dict, param_groups) ---
    def get_state(self, k: int, i: int) -> Tensor:
        return self.state[k][i]

    def set_state(self, i: int, values: List[Tensor], present: bool) -> None:
        for k in range(self.num_slots):
            self.state[k][i] = values[k]
        self._note_layout(i, values)
        self.has_state[i] = present
        self.epoch += 1
        b = self.bucket_index[i]
        self.bucket_ready[b] = False
        self.full[b] = torch.jit.annotate(List[List[Tensor]], [])
        self.step_bases[b] = torch.empty(0)

    def state_present(self, i: int) -> bool:
        return self.has_state[i]

    def get_group(self, g: int) -> Tensor:
        return self.groups[g]

    def set_group(self, g: int, values: Tensor) -> None:
        self.groups[g] = values

    def set_hyper(self, g: int, key: str, value: float) -> None:
        self.hyper[g][key] = value

    def get_hyper(self, g: int) -> Dict[str, float]:
        return self.hyper[g]

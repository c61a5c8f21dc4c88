r"""Prodigy (Mishchenko & Defazio 2024, "Prodigy: An Expeditiously Adaptive
Parameter-Free Learner", arXiv:2306.06101): Adam whose step size ``d`` is
estimated from the distance travelled since the start.

Each step, with ``d`` and the step count ``k`` of the first param group, ``lr``
the largest group ``lr`` (groups may only differ by having ``lr = 0``),
``bc = sqrt(1 - beta2^(k+1)) / (1 - beta1^(k+1))`` if ``use_bias_correction``
else 1, ``dlr = d * lr * bc``, ``beta3`` defaulting to ``sqrt(beta2)``, and for
each parameter :math:`p` (start value :math:`p_0`, gradient :math:`g`, plus
``weight_decay * p`` unless ``decouple``), ``[::slice_p]`` every ``slice_p``-th
element of the flattened tensor:

First pass (groups with ``lr > 0``)::

    numerator += (d / d0) * dlr * <g[::slice_p], p0 - p[::slice_p]>
    m = beta1 * m + d * (1 - beta1) * g
    v = beta2 * v + d^2 * (1 - beta2) * g^2
    s = beta3 * s + (d / d0) * (d if safeguard_warmup else dlr) * g[::slice_p]
    denominator += sum(|s|)

Then, over all parameters (and, distributed, all ranks)::

    d_numerator = beta3 * d_numerator + numerator
    d_hat = d_coef * d_numerator / denominator
    d = max(d, d_hat) if d == d0;  d_max = max(d_max, d_hat);  d = min(d_max, growth_rate * d)

Second pass (the new ``d``)::

    p -= weight_decay * dlr * p                      # decouple only
    p -= dlr * m / (sqrt(v) + d * eps)                # beta1 = 0: dlr * d * g / (...)

and every group's ``k += 1``.  A step whose ``denominator`` is 0 (no gradient
has moved ``s`` yet) stops after the first pass, as the oracle does.

Oracle: ``prodigyopt.Prodigy`` (1.1.2; a test-only dependency).  Its
param_groups keep ``k``, ``d``, ``d_max``, ``d_numerator``, ``d_denom``,
``d_hat`` (funcopt's ``group_state``); per parameter ``step``, ``s``, ``p0``,
``exp_avg`` (``beta1 > 0``), ``exp_avg_sq``.  Differences, by decision:
``p0`` is always the strided copy of the start value (the oracle stores a 0-d
zero for an all-zero parameter; loading one gives zeros of the strided shape,
the same numbers); funcopt never writes into the caller's gradients (the
oracle adds coupled decay to ``p.grad`` in place); ``fsdp_in_use`` is
accepted and stored but has no effect: funcopt's sums are always over every
rank that holds parameters (ZeRO and the RPC optimizer add the partial sums up
across ranks, ``Optimizer.sum_partials``); per-parameter ``step`` counts
first passes (the oracle's second), which differs only on a step that stops
after the first pass.  Sparse and complex gradients are refused.
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import step_tensor, zeros_like


def _strided(t: Tensor, slice_p: int) -> Tensor:
    return t.reshape(-1)[::slice_p]


class ProdigyKernel:
    """Prodigy for the shared core: slots step, s, p0, exp_avg (beta1 > 0),
    exp_avg_sq; group state k, d, d_max, d_numerator, d_denom, d_hat; two
    passes with the sums in between (``partial``/``combine``)."""

    def __init__(self) -> None:
        self.name = "Prodigy"
        # one step's bookkeeping across group(), dense() and combine() calls
        self.fresh = True  # the next group() starts a step
        self.second = False  # dense() runs the second pass
        self.stop = False  # the step ended after its first pass (denominator 0)
        self.lrs = torch.jit.annotate(List[float], [])
        self.first_h = torch.jit.annotate(Dict[str, float], {})
        self.last_d0 = 1e-6
        self.k0 = 0.0
        self.d = 1e-6
        self.d_old = 1e-6
        self.d_max = 1e-6
        self.d_numerator = 0.0
        self.numerator = 0.0
        self.denominator = 0.0
        # under torch.compile (no host reads: fullgraph): the same quantities as 0-d float64 tensors
        self.gt = torch.zeros(6, dtype=torch.float64)  # the first group's values
        self.sums = torch.zeros(2, dtype=torch.float64)  # numerator, denominator of the first pass
        self.d_t = torch.zeros((), dtype=torch.float64)  # d after combine
        self.dlr_t = torch.zeros((), dtype=torch.float64)  # this step's dlr (the old d)
        self.keep_t = torch.ones((), dtype=torch.float64)  # 0.0: the step stopped after its first pass

    # ------------------------------------------------------------ GroupRule
    def group(self, gs: Tensor, h: Dict[str, float]) -> None:
        if self.fresh:
            self.fresh = False
            self.second = False
            self.stop = False
            self.lrs = torch.jit.annotate(List[float], [])
            self.first_h = h
            if torch.compiler.is_compiling():
                self.gt = gs
                self.sums = torch.zeros(2, dtype=torch.float64)
                self.lrs.append(h["lr"])
                self.last_d0 = h["d0"]
                return
            vals: List[float] = gs.tolist()
            self.k0 = vals[0]
            self.d = vals[1]
            self.d_old = vals[1]
            self.d_max = vals[2]
            self.d_numerator = vals[3]
            self.numerator = 0.0
            self.denominator = 0.0
        lr = h["lr"]
        for seen in self.lrs:
            if lr != seen and lr != 0.0 and seen != 0.0:
                self.fresh = True
                raise RuntimeError("Prodigy: setting different lr values in different parameter groups is only "
                                   "supported for values of 0")
        self.lrs.append(lr)
        self.last_d0 = h["d0"]

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        pass

    def partial(self, groups: List[Tensor]) -> Tensor:
        if torch.compiler.is_compiling():
            return self.sums.clone()
        out = torch.zeros(2, dtype=torch.float64)
        out[0].fill_(self.numerator)  # (not torch.tensor(list): TorchScript rounds it through float32)
        out[1].fill_(self.denominator)
        return out

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        self.fresh = True
        if torch.compiler.is_compiling():
            self._combine_tensors(groups, total)
            return
        sums: List[float] = total.tolist()
        h = self.first_h
        lr = self._lr()
        beta3 = self._beta3(h)
        d_denom = sums[1]
        if d_denom == 0.0:
            self.stop = True
            return
        d = self.d
        d_max = self.d_max
        d_numerator = self.d_numerator * beta3
        d_hat = d
        if lr > 0.0:
            d_numerator = d_numerator + sums[0]
            d_hat = h["d_coef"] * d_numerator / d_denom
            if d == self.last_d0:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * h["growth_rate"])
        self.d = d
        for gs in groups:  # (element by element: TorchScript's torch.tensor(list) rounds through float32)
            gs[0].add_(1.0)
            gs[1].fill_(d)
            gs[2].fill_(d_max)
            gs[3].fill_(d_numerator)
            gs[4].fill_(d_denom)
            gs[5].fill_(d_hat)
        self.second = True

    @torch.jit.unused
    def _combine_tensors(self, groups: List[Tensor], total: Tensor) -> None:
        """:meth:`combine` without host reads (torch.compile): the stop on a zero
        denominator as a mask (``keep_t``) on every update."""
        h = self.first_h
        gt = self.gt
        den = total[1]
        keep = den != 0
        safe = torch.where(keep, den, torch.ones_like(den))
        d = gt[1]
        d_numerator = gt[3] * self._beta3(h)
        d_hat = d
        d_max = gt[2]
        if self._lr() > 0.0:
            d_numerator = d_numerator + total[0]
            d_hat = h["d_coef"] * d_numerator / safe
            d = torch.where(d == self.last_d0, torch.maximum(d, d_hat), d)
            d_max = torch.maximum(d_max, d_hat)
            d = torch.minimum(d_max, d * h["growth_rate"])
        self.d_t = torch.where(keep, d, gt[1])
        self.keep_t = keep.to(torch.float64)
        for gs in groups:
            new = torch.stack([gs[0] + 1.0, d, d_max, d_numerator, den, d_hat])
            gs.copy_(torch.where(keep, new, gs))
        self.second = True

    @torch.jit.unused
    def _dense_tensors(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                       h: Dict[str, float]) -> None:
        """Both passes without host reads (torch.compile): every step-dependent scalar a
        0-d float64 tensor, foreach ops with tensor operands (rounding may differ from eager)."""
        h0 = self.first_h
        beta1 = h0["betas0"]
        beta2 = h0["betas1"]
        gt = self.gt
        decay = h["weight_decay"]
        decouple = h["decouple"] != 0.0
        if decay != 0 and not decouple:
            grads = torch._foreach_add(grads, params, alpha=decay)
        if not self.second:
            k = gt[0]
            bc = torch.ones((), dtype=torch.float64)
            if h0["use_bias_correction"] != 0.0:
                bc = torch.sqrt(1 - torch.pow(beta2, k + 1)) / (1 - torch.pow(beta1, k + 1))
            d = gt[1]
            dlr = d * self._lr() * bc
            self.dlr_t = dlr
            if h["lr"] <= 0.0:
                return
            d0 = h["d0"]
            sp = int(h["slice_p"])
            num = self.sums[0]
            for j in range(len(params)):
                sg = _strided(grads[j], sp)
                num = num + (d / d0) * dlr * torch.dot(sg, state[2][j] - _strided(params[j], sp)).to(torch.float64)
            if beta1 > 0:
                torch._foreach_mul_(state[3], beta1)
                torch._foreach_add_(state[3], torch._foreach_mul(grads, d * (1 - beta1)))
            torch._foreach_mul_(state[4], beta2)
            torch._foreach_addcmul_(state[4], torch._foreach_mul(grads, d * d * (1 - beta2)), grads)
            torch._foreach_mul_(state[1], self._beta3(h0))
            alpha = (d / d0) * d if h["safeguard_warmup"] != 0.0 else (d / d0) * dlr
            torch._foreach_add_(state[1], torch._foreach_mul([_strided(g, sp) for g in grads], alpha))
            den = self.sums[1]
            for t in state[1]:
                den = den + t.abs().sum().to(torch.float64)
            self.sums = torch.stack([num, den])
            return
        d = self.d_t
        dlr = self.dlr_t * self.keep_t
        denom = torch._foreach_sqrt(state[4])
        torch._foreach_add_(denom, d * h["eps"])
        if decay != 0 and decouple:
            torch._foreach_add_(params, torch._foreach_mul(params, -decay * dlr))
        if beta1 > 0:
            upd = torch._foreach_div(state[3], denom)
            torch._foreach_mul_(upd, -dlr)
        else:
            upd = torch._foreach_div(grads, denom)
            torch._foreach_mul_(upd, -dlr * d)
        torch._foreach_add_(params, upd)

    # --------------------------------------------------------------- Kernel
    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        sp = int(h["slice_p"])
        exp_avg = zeros_like(p) if h["betas0"] > 0 else torch.empty(0)
        return [step_tensor(p, False), torch.zeros_like(_strided(p, sp)),
                _strided(p.detach(), sp).clone(), exp_avg, zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        for i in idx:
            if params[i].is_complex():
                raise RuntimeError("funcopt: Prodigy does not support complex parameters (parameter "
                                   + str(i) + ")")

    def _lr(self) -> float:
        lr = 0.0
        for x in self.lrs:
            lr = max(lr, x)
        return lr

    def _beta3(self, h: Dict[str, float]) -> float:
        beta3 = h.get("beta3", float("nan"))
        if math.isnan(beta3):
            beta3 = math.sqrt(h["betas1"])
        return beta3

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        if self.stop:
            return
        if torch.compiler.is_compiling():
            self._dense_tensors(params, grads, state, h)
            return
        h0 = self.first_h
        beta1 = h0["betas0"]
        beta2 = h0["betas1"]
        lr = self._lr()
        k = self.k0
        bc = 1.0
        if h0["use_bias_correction"] != 0.0:
            bc = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        dlr = self.d_old * lr * bc
        decay = h["weight_decay"]
        decouple = h["decouple"] != 0.0
        if decay != 0 and not decouple:
            grads = torch._foreach_add(grads, params, alpha=decay)
        if not self.second:
            self._first_pass(params, grads, state, h, beta1, beta2, dlr)
        else:
            self._second_pass(params, grads, state, h, beta1, dlr)

    def _first_pass(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                    h: Dict[str, float], beta1: float, beta2: float, dlr: float) -> None:
        if h["lr"] <= 0.0:
            return
        d = self.d_old
        d0 = h["d0"]
        sp = int(h["slice_p"])
        beta3 = self._beta3(self.first_h)
        ss = state[1]
        p0s = state[2]
        for j in range(len(params)):
            sg = _strided(grads[j], sp)
            self.numerator += (d / d0) * dlr * float(torch.dot(sg, p0s[j] - _strided(params[j], sp)).item())
        if beta1 > 0:
            torch._foreach_mul_(state[3], beta1)
            torch._foreach_add_(state[3], grads, alpha=d * (1 - beta1))
        torch._foreach_mul_(state[4], beta2)
        torch._foreach_addcmul_(state[4], grads, grads, value=d * d * (1 - beta2))
        torch._foreach_mul_(ss, beta3)
        if h["safeguard_warmup"] != 0.0:
            alpha = (d / d0) * d
        else:
            alpha = (d / d0) * dlr
        if sp == 1:
            torch._foreach_add_(ss, [g.reshape(-1) for g in grads], alpha=alpha)
        else:
            torch._foreach_add_(ss, [_strided(g, sp) for g in grads], alpha=alpha)
        for s in ss:
            self.denominator += float(s.abs().sum().item())

    def _second_pass(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                     h: Dict[str, float], beta1: float, dlr: float) -> None:
        d = self.d
        denom = torch._foreach_sqrt(state[4])
        torch._foreach_add_(denom, d * h["eps"])
        decay = h["weight_decay"]
        if decay != 0 and h["decouple"] != 0.0:
            torch._foreach_add_(params, params, alpha=-decay * dlr)
        if beta1 > 0:
            torch._foreach_addcdiv_(params, state[3], denom, value=-dlr)
        else:
            torch._foreach_addcdiv_(params, grads, denom, value=-dlr * d)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        return state  # sparse gradients are refused (sparse_msg); no differentiable step


class Prodigy(Optimizer):
    r"""Prodigy (Mishchenko & Defazio 2024): Adam with a learned step size
    ``d``, as ``prodigyopt.Prodigy``, with a functional, scriptable step whose
    ``d`` estimate sums over every parameter -- under ZeRO and the RPC
    optimizer, over every rank (one all-reduce of two numbers per step).

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: multiplies the learned step size; leave it at ``1.0`` (default).
        Groups may differ only by ``lr = 0``.
      betas: ``(beta1, beta2)`` Adam's moving averages (default ``(0.9, 0.999)``).
      beta3: decay of ``s`` and of the numerator (default ``None``: ``sqrt(beta2)``).
      eps: added to the denominator, times ``d`` (default ``1e-8``).
      weight_decay: decay coefficient (default ``0``).
      decouple: AdamW-style decay ``p -= weight_decay * dlr * p`` (default ``True``);
        ``False`` adds ``weight_decay * p`` to the gradient.
      use_bias_correction: Adam's bias correction in ``dlr`` (default ``False``).
      safeguard_warmup: ``d`` instead of ``dlr`` in ``s``'s update (default ``False``).
      d0: the initial ``d`` (default ``1e-6``).
      d_coef: multiplies the estimate ``d_hat`` (default ``1.0``).
      growth_rate: largest factor ``d`` may grow by per step (default ``inf``).
      fsdp_in_use: accepted and stored; funcopt always sums over every rank.
      slice_p: estimate ``d`` from every ``slice_p``-th element (default ``1``: all).
      impl: ``"auto"`` or ``"foreach"`` (the same formula; there is no fused kernel).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.Prodigy([w], lr=1.0)
        >>> for _ in range(3):
        ...     opt.step([torch.tensor([1.0, -1.0])])
        >>> opt.param_groups[0]["k"], opt.param_groups[0]["d"] > 1e-6
        (2, True)
    """

    torch_class = "prodigyopt:Prodigy"
    kernel_class = ProdigyKernel
    sparse_msg = "Prodigy does not support sparse gradients"
    slots = (("step", None), ("s", None), ("p0", None), ("exp_avg", "betas0"), ("exp_avg_sq", None))
    fused_devices = ()
    group_state = (("k", 0), ("d", 1e-6), ("d_max", 1e-6), ("d_numerator", 0.0), ("d_denom", 0.0),
                   ("d_hat", 0.0))
    phases = 2
    step_as_int = True

    def __init__(self, params: Any, lr: float = 1.0, betas: Tuple[float, float] = (0.9, 0.999),
                 beta3: Optional[float] = None, eps: float = 1e-8, weight_decay: float = 0, decouple: bool = True,
                 use_bias_correction: bool = False, safeguard_warmup: bool = False, d0: float = 1e-6,
                 d_coef: float = 1.0, growth_rate: float = float("inf"), fsdp_in_use: bool = False,
                 slice_p: int = 1, *, impl: str = "auto") -> None:
        if not 0.0 < lr:  # the constructor's lr (a group added later may have lr=0)
            raise ValueError("Invalid learning rate: {}".format(lr))
        if impl not in ("auto", "foreach"):
            raise ValueError(f"Prodigy: impl must be 'auto' or 'foreach' (no fused or native rule), got {impl!r}")
        super().__init__(params, dict(lr=lr, betas=betas, beta3=beta3, eps=eps, weight_decay=weight_decay,
                                      d=d0, d0=d0, d_max=d0, d_numerator=0.0, d_coef=d_coef, k=0,
                                      growth_rate=growth_rate, use_bias_correction=use_bias_correction,
                                      decouple=decouple, safeguard_warmup=safeguard_warmup,
                                      fsdp_in_use=fsdp_in_use, slice_p=slice_p), impl)

    @classmethod
    def check_ranges(cls, group: Dict[str, Any]) -> None:
        """prodigyopt's constructor checks, in its words, for every group (``lr >= 0``: a
        group may have 0; the constructor's must be positive), ``beta3``, ``slice_p >= 1``."""
        if "d0" in group and not 0.0 < float(group["d0"]):
            raise ValueError("Invalid d0 value: {}".format(group["d0"]))
        if "lr" in group and not 0.0 <= float(group["lr"]):  # a group may have 0 (no first pass)
            raise ValueError("Invalid learning rate: {}".format(group["lr"]))
        if "eps" in group and not 0.0 < float(group["eps"]):
            raise ValueError("Invalid epsilon value: {}".format(group["eps"]))
        betas = group.get("betas", (0.9, 0.999))
        for j in range(2):
            if not 0.0 <= float(betas[j]) < 1.0:
                raise ValueError("Invalid beta parameter at index {}: {}".format(j, betas[j]))
        beta3 = group.get("beta3")
        if beta3 is not None and (isinstance(beta3, bool) or not isinstance(beta3, (int, float))
                                  or not 0.0 <= float(beta3) < 1.0):
            raise ValueError("Invalid beta3 value: {} (None or a number in [0, 1))".format(beta3))
        if "slice_p" in group and int(group["slice_p"]) < 1:
            raise ValueError("Invalid slice_p value: {} (must be >= 1)".format(group["slice_p"]))

    @classmethod
    def adapt_entry(cls, p: Tensor, entry: Any, group: Dict[str, Any]) -> Any:
        p0 = entry.get("p0") if isinstance(entry, dict) else None
        if isinstance(p0, Tensor) and p0.dim() == 0:  # prodigyopt's p0 of an all-zero parameter
            shape = cls.slot_shape("p0", p, group)
            entry = dict(entry, p0=p0.detach().to(p.dtype).expand(shape).clone())
        return entry

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Any = None) -> Optional[Tuple[int, ...]]:
        if name == "step":
            return ()
        if name in ("s", "p0"):
            sp = int(group.get("slice_p", 1)) if group is not None else 1
            return ((p.numel() + sp - 1) // sp,)
        return tuple(p.shape)

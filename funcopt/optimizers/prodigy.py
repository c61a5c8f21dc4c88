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
across ranks, ``Optimizer.sum_partials``); per-parameter ``step`` is torch's
0-d float32 counter (the oracle keeps a Python int; each loads the other's),
counted in the second pass as the oracle's; param groups may differ in ``lr`` only by 0, as the
oracle requires (``RuntimeError`` before anything changes).  ``slice_p > 1`` under
ZeRO's flat shards and FSDP2 samples every ``slice_p``-th element of each shard,
not of the whole parameter: another sample than one process's (``slice_p=1``,
the default, is exact).  Sparse and complex gradients are refused.
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import step_tensor, zeros_like


# options on which the oracle gives no verdict funcopt could follow: fsdp_in_use (accepted, no
# effect here; prodigyopt's True sends its sums through CUDA)
NO_ORACLE_VERDICT = ("fsdp_in_use",)


def _strided(t: Tensor, slice_p: int) -> Tensor:
    return t.reshape(-1)[::slice_p]


def prodigy_first_pass(
    params: List[Tensor],
    grads: List[Tensor],
    ss: List[Tensor],
    p0s: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    d: float,
    dlr: float,
    beta1: float,
    beta2: float,
    beta3: float,
    d0: float,
    slice_p: int,
    safeguard_warmup: bool,
) -> Tuple[float, float]:
    """The first pass over aligned lists (gradients with any coupled decay added), in
    place: the moments and ``s``; returns this list's ``(numerator, denominator)`` terms
    (``exp_avgs`` may be empty when ``beta1 == 0``)."""
    numerator = 0.0
    denominator = 0.0
    if len(params) == 0:
        return numerator, denominator
    for j in range(len(params)):
        sg = _strided(grads[j], slice_p)
        numerator += (d / d0) * dlr * float(torch.dot(sg, p0s[j] - _strided(params[j], slice_p)).item())
    if beta1 > 0:
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=d * (1 - beta1))
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=d * d * (1 - beta2))
    torch._foreach_mul_(ss, beta3)
    alpha = (d / d0) * d if safeguard_warmup else (d / d0) * dlr
    torch._foreach_add_(ss, [_strided(g, slice_p) for g in grads], alpha=alpha)
    for t in ss:
        denominator += float(t.abs().sum().item())
    return numerator, denominator


def prodigy_second_pass(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    d: float,
    dlr: float,
    beta1: float,
    eps: float,
    weight_decay: float,
    decouple: bool,
) -> None:
    """The second pass, in place: ``d`` the new estimate, ``dlr`` the step's (from the d it
    started with)."""
    if len(params) == 0:
        return
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, d * eps)
    if weight_decay != 0 and decouple:
        torch._foreach_add_(params, params, alpha=-weight_decay * dlr)
    if beta1 > 0:
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-dlr)
    else:
        torch._foreach_addcdiv_(params, grads, denom, value=-dlr * d)


# each group's vector: group_state (0 k, 1 d, 2 d_max, 3 d_numerator, 4 d_denom, 5 d_hat), then
# this step's values, the same in every group but the partial sums (group_hidden): written by
# group() and combine(), read by dense() -- the kernel object holds nothing between calls (a
# module scripted from an eager core may hold two copies of it, as Kernel and as GroupRule)
# (as literals in the kernel: TorchScript reads no module globals) 6 phase (0 first pass, 1 second,
# 2 stopped), 7 d at the step's start, 8 dlr, 9 the largest lr, 10-12 group 0's beta1, beta2, beta3,
# 13 d_coef, 14 growth_rate, 15 the last group's d0, 16-17 this group's numerator and denominator
_HIDDEN = 12


class ProdigyKernel:
    """Prodigy for the shared core: slots step, s, p0, exp_avg (beta1 > 0),
    exp_avg_sq; group state k, d, d_max, d_numerator, d_denom, d_hat; two
    passes with the sums in between (``partial``/``combine``)."""

    def __init__(self) -> None:
        self.name = "Prodigy"

    # ------------------------------------------------------------ GroupRule
    def group(self, groups: List[Tensor], hs: List[Dict[str, float]]) -> None:
        """The step's start: the oracle's values from group 0 (betas, beta3, d, k: its
        dlr), the largest lr, the last group's d0 -- into every group's vector."""
        lr = 0.0
        for h in hs:
            if h["lr"] != lr and h["lr"] != 0.0 and lr != 0.0:
                raise RuntimeError("Prodigy: setting different lr values in different parameter groups is only "
                                   "supported for values of 0")
            lr = max(lr, h["lr"])
        h0 = hs[0]
        beta1 = h0["betas0"]
        beta2 = h0["betas1"]
        beta3 = h0.get("beta3", float("nan"))
        if math.isnan(beta3):  # None: sqrt(beta2)  (not beta3 != beta3: TorchScript folds that to False)
            beta3 = math.sqrt(beta2)
        g0 = groups[0]
        if torch.compiler.is_compiling():  # no host reads: the same arithmetic on 0-d tensors
            k = g0[0]
            bc = torch.ones((), dtype=torch.float64)
            if h0["use_bias_correction"] != 0.0:
                bc = torch.sqrt(1 - torch.pow(beta2, k + 1)) / (1 - torch.pow(beta1, k + 1))
            dlr = g0[1] * lr * bc
            for gs in groups:
                gs[6:].copy_(torch.stack([torch.zeros((), dtype=torch.float64), g0[1], dlr] + [
                    torch.full((), v, dtype=torch.float64)
                    for v in [lr, beta1, beta2, beta3, h0["d_coef"], h0["growth_rate"], hs[-1]["d0"], 0.0, 0.0]]))
            return
        k = float(g0[0].item())
        d = float(g0[1].item())
        bc = 1.0
        if h0["use_bias_correction"] != 0.0:
            bc = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        dlr = d * lr * bc
        for gs in groups:  # element by element: TorchScript's torch.tensor(list) rounds through float32
            gs[6].fill_(0.0)
            gs[7].fill_(d)
            gs[8].fill_(dlr)
            gs[9].fill_(lr)
            gs[10].fill_(beta1)
            gs[11].fill_(beta2)
            gs[12].fill_(beta3)
            gs[13].fill_(h0["d_coef"])
            gs[14].fill_(h0["growth_rate"])
            gs[15].fill_(hs[len(hs) - 1]["d0"])  # the oracle compares d with its last group's d0
            gs[16].fill_(0.0)
            gs[17].fill_(0.0)

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        pass

    def partial(self, groups: List[Tensor]) -> Tensor:
        out = groups[0][16:17 + 1].clone()
        for gs in groups[1:]:
            out = out + gs[16:17 + 1]
        return out

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        g0 = groups[0]
        if torch.compiler.is_compiling():
            self._combine_tensors(groups, total)
            return
        v: List[float] = g0.tolist()
        sums: List[float] = total.tolist()
        d_denom = sums[1]
        if d_denom == 0.0:  # no gradient has moved s yet: the step ends here, as the oracle's
            for gs in groups:
                gs[6].fill_(2.0)
            return
        d = v[1]
        d_max = v[2]
        d_numerator = v[3] * v[12]
        d_hat = d
        if v[9] > 0.0:
            d_numerator = d_numerator + sums[0]
            d_hat = v[13] * d_numerator / d_denom
            if d == v[15]:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * v[14])
        for gs in groups:
            gs[0].add_(1.0)
            gs[1].fill_(d)
            gs[2].fill_(d_max)
            gs[3].fill_(d_numerator)
            gs[4].fill_(d_denom)
            gs[5].fill_(d_hat)
            gs[6].fill_(1.0)

    @torch.jit.unused
    def _combine_tensors(self, groups: List[Tensor], total: Tensor) -> None:
        """:meth:`combine` without host reads (torch.compile): the stop on a zero
        denominator as a where() on every value (phase 2: the second pass does nothing)."""
        g0 = groups[0]
        den = total[1]
        keep = den != 0
        safe = torch.where(keep, den, torch.ones_like(den))
        d, d_max = g0[1], g0[2]
        d_numerator = g0[3] * g0[12]
        d_hat = d
        if self._lr_positive(g0):
            d_numerator = d_numerator + total[0]
            d_hat = g0[13] * d_numerator / safe
            d = torch.where(d == g0[15], torch.maximum(d, d_hat), d)
            d_max = torch.maximum(d_max, d_hat)
            d = torch.minimum(d_max, d * g0[14])
        phase = torch.where(keep, 1.0, 2.0).to(torch.float64)
        for gs in groups:
            new = torch.stack([gs[0] + 1.0, d, d_max, d_numerator, den, d_hat])
            gs[:6].copy_(torch.where(keep, new, gs[:6]))
            gs[6].copy_(phase)

    @torch.jit.unused
    def _lr_positive(self, gs: Tensor) -> bool:
        return True  # combine's lr > 0 under compile: the constructor's lr is; a group's lr=0 is no first pass

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

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        gs = state[len(state) - 1][0]
        decay = h["weight_decay"]
        decouple = h["decouple"] != 0.0
        if decay != 0 and not decouple:
            grads = torch._foreach_add(grads, params, alpha=decay)
        if torch.compiler.is_compiling():
            self._dense_tensors(params, grads, state, h, gs)
            return
        v: List[float] = gs.tolist()
        if v[6] == 0.0:
            self._first_pass(params, grads, state, h, v, gs)
        elif v[6] == 1.0:
            self._second_pass(params, grads, state, h, v)

    def _first_pass(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                    h: Dict[str, float], v: List[float], gs: Tensor) -> None:
        if h["lr"] <= 0.0:
            return
        num, den = prodigy_first_pass(params, grads, state[1], state[2], state[3], state[4], v[7], v[8], v[10],
                                      v[11], v[12], h["d0"], int(h["slice_p"]), h["safeguard_warmup"] != 0.0)
        gs[16].fill_(v[16] + num)
        gs[17].fill_(v[17] + den)

    def _second_pass(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                     h: Dict[str, float], v: List[float]) -> None:
        torch._foreach_add_(state[0], 1.0)  # the per-parameter step (the oracle's state['step'] += 1)
        prodigy_second_pass(params, grads, state[3], state[4], v[1], v[8], v[10], h["eps"], h["weight_decay"],
                            h["decouple"] != 0.0)

    @torch.jit.unused
    def _dense_tensors(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                       h: Dict[str, float], gs: Tensor) -> None:
        """Both passes without host reads (torch.compile): every step-dependent scalar a
        0-d float64 tensor from ``gs``, foreach ops with tensor operands (rounding may
        differ from eager); the phase as masks."""
        first = (gs[6] == 0.0).to(torch.float64)
        second = (gs[6] == 1.0).to(torch.float64)
        beta1 = h["betas0"]  # group 0's (the registry's classes: every group's; see group())
        if h["lr"] > 0.0:
            d, dlr, d0 = gs[7], gs[8], h["d0"]
            sp = int(h["slice_p"])
            num = gs[16]
            for j in range(len(params)):
                sg = _strided(grads[j], sp)
                num = num + (d / d0) * dlr * torch.dot(sg, state[2][j] - _strided(params[j], sp)).to(torch.float64)
            # the first pass's moments, or (second pass) unchanged: interpolate by the mask
            keep1 = 1.0 - first
            if beta1 > 0:
                f = gs[10] * first + keep1
                torch._foreach_mul_(state[3], f)
                torch._foreach_add_(state[3], torch._foreach_mul(grads, d * (1 - gs[10]) * first))
            torch._foreach_mul_(state[4], gs[11] * first + keep1)
            torch._foreach_addcmul_(state[4], torch._foreach_mul(grads, d * d * (1 - gs[11]) * first), grads)
            torch._foreach_mul_(state[1], gs[12] * first + keep1)
            alpha = (d / d0) * d if h["safeguard_warmup"] != 0.0 else (d / d0) * dlr
            torch._foreach_add_(state[1], torch._foreach_mul([_strided(g, sp) for g in grads], alpha * first))
            den = gs[17]
            for t in state[1]:
                den = den + t.abs().sum().to(torch.float64)
            gs[16:17 + 1].copy_(torch.where(first > 0, torch.stack([num, den]), gs[16:17 + 1]))
        torch._foreach_add_(state[0], second.to(torch.float32))  # the step: in the second pass only
        d = gs[1]
        dlr = gs[8] * second
        denom = torch._foreach_sqrt(state[4])
        torch._foreach_add_(denom, d * h["eps"])
        decay = h["weight_decay"]
        if decay != 0 and h["decouple"] != 0.0:
            torch._foreach_add_(params, torch._foreach_mul(params, -decay * dlr))
        if beta1 > 0:
            upd = torch._foreach_div(state[3], denom)
            torch._foreach_mul_(upd, -dlr)
        else:
            upd = torch._foreach_div(grads, denom)
            torch._foreach_mul_(upd, -dlr * d)
        torch._foreach_add_(params, upd)

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
    group_hidden = _HIDDEN
    group_state_lazy = ("d_denom", "d_hat")
    one_lr = True
    complex_differs_from_oracle = True  # refused (prodigyopt runs them through a complex dot product)
    fixed_once_stepped = ("slice_p",)  # it shapes s and p0
    core_bumps_step = False  # counted in the second pass, as the oracle's (a step may stop before it)  # param groups may differ in lr only by 0 (the oracle's rule: one d for all)
    phases = 2

    def __init__(self, params: Any, lr: float = 1.0, betas: Tuple[float, float] = (0.9, 0.999),
                 beta3: Optional[float] = None, eps: float = 1e-8, weight_decay: float = 0, decouple: bool = True,
                 use_bias_correction: bool = False, safeguard_warmup: bool = False, d0: float = 1e-6,
                 d_coef: float = 1.0, growth_rate: float = float("inf"), fsdp_in_use: bool = False,
                 slice_p: int = 1, *, impl: str = "auto") -> None:
        if isinstance(lr, (int, float)) and not 0.0 < lr:  # the constructor's (a group added later may have 0)
            raise ValueError("Invalid learning rate: {} (lr={!r})".format(lr, lr))
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
        def bad(msg: str, key: str, value: Any) -> None:
            raise ValueError(f"{msg} ({key}={value!r})")

        if "d0" in group and not 0.0 < float(group["d0"]):
            bad("Invalid d0 value: {}".format(group["d0"]), "d0", group["d0"])
        if "lr" in group and not 0.0 <= float(group["lr"]):  # a group may have 0 (no first pass)
            bad("Invalid learning rate: {}".format(group["lr"]), "lr", group["lr"])
        if "eps" in group and not 0.0 < float(group["eps"]):
            bad("Invalid epsilon value: {}".format(group["eps"]), "eps", group["eps"])
        betas = group.get("betas", (0.9, 0.999))
        for j in range(2):
            if not 0.0 <= float(betas[j]) < 1.0:
                bad("Invalid beta parameter at index {}: {}".format(j, betas[j]), "betas", betas)
        beta3 = group.get("beta3")
        if beta3 is not None and (isinstance(beta3, bool) or not isinstance(beta3, (int, float))
                                  or not 0.0 <= float(beta3) < 1.0):
            bad("Invalid beta3 value: {} (None or a number in [0, 1))".format(beta3), "beta3", beta3)
        if "slice_p" in group and int(group["slice_p"]) < 1:
            bad("Invalid slice_p value: {} (must be >= 1)".format(group["slice_p"]), "slice_p", group["slice_p"])

    @classmethod
    def adapt_entry(cls, p: Tensor, entry: Any, group: Dict[str, Any]) -> Any:
        """A loaded entry as funcopt keeps it: prodigyopt's 0-d ``p0`` of an all-zero
        parameter becomes the strided zeros; an ``s`` shaped by another ``slice_p`` is refused."""
        shape = cls.slot_shape("p0", p, group)
        if isinstance(entry, dict) and shape == (p.numel(),) and p.dim() > 1:
            # s and p0 in the parameter's shape (FSDP2 shows them so, sharded like it): flattened
            entry = dict(entry, **{k: v.reshape(-1) for k, v in entry.items()
                                   if k in ("s", "p0") and isinstance(v, Tensor) and tuple(v.shape) == tuple(p.shape)})
        p0 = entry.get("p0") if isinstance(entry, dict) else None
        if isinstance(p0, Tensor) and p0.dim() == 0:  # prodigyopt's p0 of an all-zero parameter
            entry = dict(entry, p0=p0.detach().to(p.dtype).expand(shape).clone())
        s = entry.get("s") if isinstance(entry, dict) else None
        if isinstance(s, Tensor) and tuple(s.shape) != shape and s.dim() == 1:
            raise ValueError(f"Prodigy.load_state_dict: 's' has {s.numel()} elements, but slice_p="
                             f"{group.get('slice_p')!r} gives {shape[0]} for this parameter (slice_p shapes the "
                             f"state: load with the slice_p it was saved with)")
        return entry

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Any = None) -> Optional[Tuple[int, ...]]:
        """``step`` 0-d; ``s`` and ``p0`` every ``slice_p``-th element of the flattened
        parameter (``group``'s ``slice_p``, 1 without a group); the moments shaped like ``p``."""
        if name == "step":
            return ()
        if name in ("s", "p0"):
            sp = int(group.get("slice_p", 1)) if group is not None else 1
            return ((p.numel() + sp - 1) // sp,)
        return tuple(p.shape)

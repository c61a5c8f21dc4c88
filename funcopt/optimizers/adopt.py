r"""ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any
beta2 with the Optimal Rate", arXiv:2411.02853).

Adam's two changes: the gradient is normalized by the *previous* second
moment (so the current gradient does not scale itself), and the momentum is
taken of that normalized gradient.  With ``t`` the group's step counter
(``group['step']``, 1 on the first step), ``maximize`` negating ``g`` and
weight decay ``wd`` applied first (coupled: ``g += wd * p``; decoupled:
``p *= 1 - wd * lr``, or ``1 - wd`` with ``fixed_decay``)::

    t = 1:  v = v + g * g                        # the first step only fills v
    t > 1:  n = g / max(sqrt(v), eps)
            n = clamp(n, -t^(1/4), t^(1/4))      # clip_lambda (None: no clipping)
            m = m + (1 - beta1) * (n - m)        # lerp
            p = p - lr * m
            v = beta2 * v + (1 - beta2) * g * g

The oracle is ``pytorch_optimizer.ADOPT`` (pytorch-optimizer 4.1.0, a test
dependency): same arguments and defaults, same state (``exp_avg``,
``exp_avg_sq``), the step counter per param group (``group['step']``, bumped
on every ``step()`` for every group).  The foreach formula runs the oracle's
foreach operations in its order: bitwise equal in float32 and float64.
Complex parameters are updated through real views (as the oracle's
per-parameter path does); sparse gradients are refused.

``clip_lambda``: the oracle takes any Python callable of the step; the
scripted step cannot call Python, so funcopt supports exactly the two values
that matter -- the default ``step ** 0.25`` and ``None`` (no clipping) -- and
refuses any other callable with a ``ValueError`` naming them.  In
``param_groups`` the option reads ``'step ** 0.25'`` or ``None``: plain data,
so a state dict saves and loads (``torch.load(weights_only=True)``) without
pickled functions.

The oracle keeps ``clip_lambda`` and ``maximize`` on the instance, not in its
param groups; funcopt keeps them in ``param_groups`` (per group, like every
hyperparameter here) but writes its ``state_dict`` in the oracle's format: a
group's ``clip_lambda``/``maximize`` is left out where it equals the
constructor's, and a loaded group that lacks them (the oracle's, or such a
one) takes the constructor's -- the oracle's rule.  A group with its own
value keeps it through a save and load here; the oracle ignores the key.
The oracle's per-parameter path (``foreach=False``, complex parameters) runs
the same operations per tensor; funcopt's ``foreach=False`` runs the foreach
formula (the same numbers).
"""
import math
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import zeros_like
from ._core import StepCounter

# the value clip_lambda's default stands for in param_groups and the kernel's code for it
CLIP_DEFAULT = "step ** 0.25"


def default_clip_lambda(step: float) -> float:
    """ADOPT's default clipping bound, ``step ** 0.25`` (the oracle's default)."""
    return math.pow(step, 0.25)


def adopt(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    step: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    weight_decouple: bool,
    fixed_decay: bool,
    clip: bool,
    maximize: bool,
) -> None:
    """Functional ADOPT over aligned tensor lists of one device and dtype,
    updated in place.  ``step``: the group's counter (a 0-d or 1-element
    tensor, already bumped for this step; 1 on the first step).  ``clip``:
    clamp the normalized gradient to ``[-step ** 0.25, step ** 0.25]``.

    Eagerly and scripted, the oracle's foreach operations in its order
    (bitwise equal); under ``torch.compile`` a branch-free form with the
    per-step scalars as tensors (no host read of ``step``)."""
    if len(params) == 0:
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0.0:
        if weight_decouple:
            factor = 1.0 - weight_decay if fixed_decay else 1.0 - weight_decay * lr
            torch._foreach_mul_(params, factor)
        elif maximize:  # our own list: in place
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if torch.compiler.is_compiling():
        _adopt_compiled(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, clip)
        return
    t = float(step.reshape([]))
    if t == 1.0:
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads)
        return
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_clamp_min_(denoms, eps)
    normed = torch._foreach_div(grads, denoms)
    if clip:
        bound = math.pow(t, 0.25)
        torch._foreach_maximum_(normed, -bound)
        torch._foreach_minimum_(normed, bound)
    torch._foreach_lerp_(exp_avgs, normed, 1.0 - beta1)
    torch._foreach_add_(params, exp_avgs, alpha=-lr)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)


def _adopt_compiled(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                    step: Tensor, lr: float, beta1: float, beta2: float, eps: float, clip: bool) -> None:
    """The rule under torch.compile: no branch on the step's value.  On the
    first step the normalized gradient is replaced by 0 (``g / eps`` may
    overflow there), the momentum's weight and the parameter's step are 0 and
    v's decay is 1, which leaves ``m`` and ``p`` as they are and adds
    ``g * g`` to ``v``; later steps are the eager rule.  Equal to eager to
    rounding."""
    dt = params[0].dtype
    t = step.reshape([]).to(device=params[0].device, dtype=torch.float64)
    is_first = torch.eq(t, 1.0)
    first = is_first.to(torch.float64)
    later = 1.0 - first
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_clamp_min_(denoms, eps)
    normed = torch._foreach_div(grads, denoms)
    if clip:
        bound = torch.pow(t, 0.25).to(dt)
        low = torch.neg(bound)
        torch._foreach_maximum_(normed, [low for _ in normed])
        torch._foreach_minimum_(normed, [bound for _ in normed])
    normed = [torch.where(is_first, 0.0, n) for n in normed]
    weight = (later * (1.0 - beta1)).to(dt)
    torch._foreach_lerp_(exp_avgs, normed, [weight for _ in exp_avgs])
    moved = torch._foreach_mul(exp_avgs, (later * -lr).to(dt))
    torch._foreach_add_(params, moved)
    torch._foreach_mul_(exp_avg_sqs, (first + later * beta2).to(dt))
    squares = torch._foreach_mul(grads, grads)
    torch._foreach_mul_(squares, (first + later * (1.0 - beta2)).to(dt))
    torch._foreach_add_(exp_avg_sqs, squares)


class ADOPTKernel:
    """ADOPT for the shared core (slots: exp_avg, exp_avg_sq; group state: step):
    a ``Kernel`` (funcopt/optimizers/_core.py; ``group["step"]``: ``StepCounter``)."""

    def __init__(self) -> None:
        self.name = "ADOPT"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [zeros_like(p), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        gs = state[len(state) - 1][0]
        adopt(params, grads, state[0], state[1], gs[0], h["lr"], h["betas0"], h["betas1"], h["eps"],
              h["weight_decay"], h["weight_decouple"] != 0.0, h["fixed_decay"] != 0.0, h["clip_lambda"] != 0.0,
              h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        return state  # never called: sparse gradients are refused, no differentiable=True


def _clip_code(clip_lambda: Any) -> Optional[str]:
    """The constructor's ``clip_lambda`` as its ``param_groups`` value."""
    if clip_lambda is None:
        return None
    if clip_lambda is default_clip_lambda or (isinstance(clip_lambda, str) and clip_lambda == CLIP_DEFAULT):
        return CLIP_DEFAULT
    if (callable(clip_lambda) and getattr(clip_lambda, "__module__", "") == "pytorch_optimizer.optimizer.adopt"
            and getattr(clip_lambda, "__qualname__", "") == "ADOPT.<lambda>"):
        return CLIP_DEFAULT  # the oracle's own default (e.g. read from its signature)
    raise ValueError(
        f"ADOPT: clip_lambda={clip_lambda!r} is not supported by funcopt: the scripted step cannot call a "
        f"Python function; supported: the default, step ** 0.25 (funcopt.optimizers.adopt.default_clip_lambda "
        f"or {CLIP_DEFAULT!r}), or None (no clipping)")


def _number(v: Any) -> Optional[float]:
    """``v`` as a float where it is a plain number or a one-element real tensor, else None
    (the type checks of funcopt/_hyper.py name anything else)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, Tensor) and v.numel() == 1 and not v.is_complex() and v.device.type != "meta":
        return float(v)
    return None


_ERRORS: Dict[Any, type] = {}


def oracle_error(name: str, msg: str) -> Exception:
    """A ``ValueError`` (funcopt's error for an invalid hyperparameter) that,
    where pytorch_optimizer is already imported, is also that package's
    exception ``name`` (its ``NegativeLRError`` is a plain ``Exception``): code
    written against the oracle (``except NegativeLRError``) still catches it.
    Never imports the package."""
    module = sys.modules.get("pytorch_optimizer.base.exception")
    base = getattr(module, name, None) if module is not None else None
    if not (isinstance(base, type) and issubclass(base, Exception)):
        return ValueError(msg)
    cls = _ERRORS.get(base)
    if cls is None:
        def __init__(self: Any, message: str) -> None:
            ValueError.__init__(self, message)
            self.message = message

        cls = type(name, (ValueError, base), {"__init__": __init__, "__module__": __name__,
                                              "__reduce__": lambda self: (ValueError, self.args)})
        _ERRORS[base] = cls
    return cls(msg)


def check_range(owner: str, group: Dict[str, Any]) -> None:
    """The oracle's range checks, in pytorch_optimizer's words, as ``ValueError``
    with the key and value (pytorch_optimizer raises a plain ``Exception`` for a
    negative lr): they hold without the oracle package installed."""
    lr = _number(group.get("lr"))
    if lr is not None and lr < 0.0:
        raise oracle_error("NegativeLRError", f"{owner}: learning rate must be positive. ({group['lr']} > 0) "
                                              f"(lr={group['lr']!r})")
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)):
        for j, v in enumerate(betas):
            b = _number(v)
            if b is None:
                continue
            closed = j == 2  # beta3 in [0, 1]; beta1, beta2 in [0, 1)
            if not (0.0 <= b and (b <= 1.0 if closed else b < 1.0)):
                interval = "[0.0, 1.0]" if closed else "[0.0, 1.0)"
                raise ValueError(f"{owner}: beta{j + 1} must be in the range {interval} (betas={betas!r})")
    for key in ("alpha", "t_alpha_beta3", "weight_decay", "eps"):
        v = _number(group.get(key))
        if v is not None and v < 0.0:
            raise ValueError(f"{owner}: {key} must be non-negative ({key}={group[key]!r})")


class ADOPT(Optimizer):
    r"""ADOPT (Taniguchi et al. 2024) with a functional, scriptable step; the
    oracle is ``pytorch_optimizer.ADOPT``.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1e-3``).
      betas: ``(beta1, beta2)``: decay of the momentum of the normalized
        gradient and of the second moment (default ``(0.9, 0.9999)``).
      clip_lambda: the bound of the normalized gradient as a function of the
        step: the default ``step ** 0.25`` or ``None`` (no clipping); any
        other callable is refused (``ValueError``: the scripted step cannot
        call Python).  In ``param_groups``: ``'step ** 0.25'`` or ``None``.
      weight_decay: decay coefficient (default ``0``).
      weight_decouple: decoupled decay, ``p *= 1 - weight_decay * lr``
        (default ``False``: coupled, ``g += weight_decay * p``).
      fixed_decay: with ``weight_decouple``, ``p *= 1 - weight_decay``
        (not scaled by ``lr``; default ``False``).
      foreach: ``foreach=True`` means ``impl="foreach"``.
      eps: lower bound of ``sqrt(v)`` (default ``1e-6``).
      maximize: ascend instead of descend (default ``False``).
      impl: ``"auto"`` (the foreach formula, cache-blocked on CPU: bitwise the
        same) or ``"foreach"`` (one foreach call per bucket); there is no
        fused or native ADOPT kernel.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.ADOPT([w], lr=0.1)
        >>> opt.step([torch.tensor([1.0, -2.0])])  # the first step only fills exp_avg_sq
        >>> w, opt.state[w]["exp_avg_sq"]
        (tensor([1., 1.], requires_grad=True), tensor([1., 4.]))
        >>> opt.step([torch.tensor([10.0, 1.0])])  # g / sqrt(v) = [10, 0.5]; 10 clipped to 2 ** 0.25
        >>> w, opt.param_groups[0]["step"]
        (tensor([0.9881, 0.9950], requires_grad=True), 2)
    """

    torch_class = "pytorch_optimizer:ADOPT"
    kernel_class = ADOPTKernel
    group_rule_class = StepCounter  # group['step'] += 1 each step
    sparse_msg = "ADOPT does not support sparse gradient."
    slots = (("exp_avg", None), ("exp_avg_sq", None))
    group_state = (("step", 0),)
    group_state_lazy = ("step",)  # pytorch_optimizer adds group['step'] at the first step
    fused_devices = ()
    hyper_codes = {"clip_lambda": {None: 0.0, CLIP_DEFAULT: 1.0}}

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[Any, Any] = (0.9, 0.9999),
                 clip_lambda: Any = default_clip_lambda, weight_decay: float = 0.0, weight_decouple: bool = False,
                 fixed_decay: bool = False, foreach: Optional[bool] = None, eps: float = 1e-6,
                 maximize: bool = False, *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, clip_lambda=_clip_code(clip_lambda),
                                      weight_decay=weight_decay, weight_decouple=weight_decouple,
                                      fixed_decay=fixed_decay, foreach=foreach, eps=eps, maximize=maximize), impl)

    def _validate_hyper(self, group: Dict[str, Any]) -> None:
        # the oracle's range checks first, as its constructor runs them (betas=(1.0, 0.9) is the
        # oracle's "beta1 must be in the range", not funcopt's tuple-length verdict)
        self.check_ranges(group)
        super()._validate_hyper(group)

    @staticmethod
    def check_ranges(group: Dict[str, Any]) -> None:
        """The oracle's range checks (funcopt/_hyper.py calls them wherever a value enters)."""
        check_range("ADOPT", group)

    def state_dict(self) -> Dict[str, Any]:
        """The oracle's format: ``clip_lambda`` and ``maximize`` only in a group
        that differs from this optimizer's defaults, ``step`` once a step ran
        (see :func:`strip_instance_keys`)."""
        return strip_instance_keys(self, super().state_dict(), INSTANCE_KEYS)

    def stage_state(self, state_dict: Dict[str, Any]) -> Any:
        """As :meth:`funcopt.Optimizer.stage_state`; a group without the options the oracle
        keeps on its instance (``INSTANCE_KEYS``) takes this optimizer's constructor values."""
        return super().stage_state(fill_instance_keys(self, state_dict, INSTANCE_KEYS))


# what pytorch_optimizer.ADOPT keeps on the instance, not in its param groups
INSTANCE_KEYS = ("clip_lambda", "maximize")


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def strip_instance_keys(opt: Optimizer, state_dict: Any, keys: Tuple[str, ...]) -> Any:
    """``state_dict`` in the format of a pytorch_optimizer class, which keeps
    ``keys`` (``maximize``, ADOPT's ``clip_lambda``) on the instance and so out
    of its param groups, and adds ``step`` to a group at its first ``step()``:
    a group's value of ``keys`` is left out where it equals ``opt.defaults``
    (the constructor's), kept where a group has its own (the oracle ignores
    it; a load here restores it); ``step`` is left out while it is 0 (the
    counter moves on every ``step()`` for every group, so 0 means none yet).
    :func:`fill_instance_keys` and the core's ``group_state`` put them back on
    load."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    for group in state_dict["param_groups"]:
        if isinstance(group, dict):
            for k in keys:
                if k in group and k in opt.defaults and _same(group[k], opt.defaults[k]):
                    del group[k]
            if _same(group.get("step"), 0):
                del group["step"]
    return state_dict


def fill_instance_keys(opt: Optimizer, state_dict: Any, keys: Tuple[str, ...]) -> Any:
    """``state_dict`` with ``keys`` a saved group lacks (a state dict of the
    oracle, or one of :func:`strip_instance_keys`) set to this optimizer's
    defaults -- the oracle's rule: they are the instance's.  The caller's dict
    is not changed; anything malformed is passed on for the checks."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    groups = []
    for saved in state_dict["param_groups"]:
        if isinstance(saved, dict) and any(k not in saved for k in keys):
            saved = dict(saved)
            for k in keys:
                if k not in saved and k in opt.defaults:
                    saved[k] = opt.defaults[k]
        groups.append(saved)
    return dict(state_dict, param_groups=groups)

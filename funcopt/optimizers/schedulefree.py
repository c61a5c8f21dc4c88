r"""Schedule-Free AdamW and SGD (Defazio et al. 2024, "The Road Less Scheduled",
arXiv:2405.15682), as the ``schedulefree`` package's ``AdamWScheduleFree`` and
``SGDScheduleFree``.

No learning-rate schedule: the rule keeps two sequences, the base iterate
:math:`z` (a plain SGD/AdamW step) and the average :math:`x` of the :math:`z`'s,
and evaluates the gradient at their interpolation :math:`y`.  The parameters
hold :math:`y` in *train* mode and :math:`x` in *eval* mode; ``train()`` and
``eval()`` swap them (call ``train()`` before stepping, ``eval()`` before
evaluating or saving).  At step :math:`k = 1, 2, \dots` of a param group, with
:math:`g` the gradient at :math:`y` ::

    lr_k   = lr * min(1, k / warmup_steps)                 # scheduled_lr
    lr_max = max(lr_max, lr_k)
    w_k    = k^r * lr_max^weight_lr_power;  weight_sum += w_k
    c      = w_k / weight_sum                               # 0 while weight_sum is 0
    # AdamW: g = g / (sqrt(v / (1 - beta2^k)) + eps), v = beta2 v + (1 - beta2) g^2
    g     += weight_decay * y                               # decay at y
    y      = lerp(y, z, c) + lr_k * (beta * (1 - c) - 1) * g
    z     -= lr_k * g

(``beta`` is ``betas[0]`` for AdamW, ``momentum`` for SGD.)  In train mode
``y = lerp(z, x, beta)``; ``eval()`` sets the parameters to
``x = lerp(y, z, 1 - 1/beta)``, ``train()`` back to ``y = lerp(x, z, 1 - beta)``.

Group state (the oracle's ``param_groups`` keys): ``k``, ``train_mode``,
``weight_sum``, ``lr_max``, ``scheduled_lr``; per-parameter state ``z`` (a copy
of the parameter at its first gradient) and, for AdamW, ``exp_avg_sq``.

Oracle: ``schedulefree`` 1.4.1 (a test-only dependency): the same foreach ops
in its order, bitwise equal in eager and scripted float32/float64 (under
torch.compile the per-step scalars are tensors: equal to rounding).
Differences, by decision: funcopt starts in train mode (the oracle starts in
eval mode and refuses to step until ``train()`` is called: the call its docs
ask for first, a no-op here, so code written for the oracle runs unchanged,
and frameworks that never call ``train()`` -- Lightning -- step); funcopt never writes into the caller's gradients
(the oracle divides ``p.grad`` in place, and adds SGD's decay to it); a param
group added by ``add_param_group`` starts in the optimizer's current mode (the
oracle's starts in eval mode, which its next ``eval()`` then skips); every
group's mode is checked before a step (the oracle checks group 0's); the
oracle's ``foreach`` is recorded, but the default ``impl="auto"`` runs the
foreach formula cache-blocked either way (the same numbers); complex
parameters are stepped through real views, as torch.optim does (the oracle's
AdamW squares a complex gradient as a complex number); the oracle's
``train()``/``eval()`` leave an empty state entry for a parameter that has had
no gradient yet, funcopt none.  Sparse gradients are refused.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer

# the group vector's elements (the classes' ``group_state`` order), by index:
# 0 k, 1 train_mode, 2 weight_sum, 3 lr_max, 4 scheduled_lr


def _eval_mode_error(name: str) -> str:
    return ("funcopt: " + name + " is in eval mode: call optimizer.train() before step() "
            "(and optimizer.eval() before evaluating or saving the model)")


def schedule_all(groups: List[Tensor], hs: List[Dict[str, float]], name: str) -> None:
    """:func:`schedule` for every param group, after checking that every one is in
    train mode (a step in eval mode changes nothing; not under torch.compile, where
    the optimizer class checks in Python before the compiled step)."""
    if not torch.compiler.is_compiling():
        for gs in groups:
            if float(gs[1].item()) == 0.0:
                raise RuntimeError(_eval_mode_error(name))
    for j in range(len(groups)):
        h = hs[j]
        schedule(groups[j], h["lr"], h["warmup_steps"], h["r"], h["weight_lr_power"], name)


def schedule(gs: Tensor, lr: float, warmup_steps: float, r: float, weight_lr_power: float, name: str) -> None:
    """One step of a param group's schedule, in place on its vector ``gs``
    (``k``, ``train_mode``, ``weight_sum``, ``lr_max``, ``scheduled_lr``):
    warmup, the running maximum of the lr, the sum of the averaging weights,
    ``k += 1``.  Raises (changing nothing) in eval mode."""
    if torch.compiler.is_compiling():
        # no host reads under torch.compile: the same arithmetic as 0-d tensors (the eval-mode
        # check is the optimizer class's, in Python, before the compiled step)
        k = gs[0]
        sched = torch.where(k < warmup_steps, (k + 1.0) / warmup_steps, 1.0)
        lr_k = sched * lr
        lr_max = torch.maximum(lr_k, gs[3])
        weight = (k + 1.0) ** r * lr_max ** weight_lr_power
        gs.copy_(torch.stack([k + 1.0, gs[1], gs[2] + weight, lr_max, lr_k]))
        return
    v: List[float] = gs.tolist()
    if v[1] == 0.0:
        raise RuntimeError(_eval_mode_error(name))
    k = v[0]
    sched = (k + 1.0) / warmup_steps if k < warmup_steps else 1.0
    lr_k = lr * sched
    lr_max = max(lr_k, v[3])
    weight = ((k + 1.0) ** r) * (lr_max ** weight_lr_power)
    # fill_ with a Scalar (a double): TorchScript's ``gs[i] = x`` and ``torch.tensor(List[float])``
    # round through float32
    gs[0].fill_(k + 1.0)
    gs[2].fill_(v[2] + weight)
    gs[3].fill_(lr_max)
    gs[4].fill_(lr_k)


def step_scalars(gs: Tensor, r: float, weight_lr_power: float) -> Tuple[float, float, float]:
    """``(k, lr, c)`` of this step from a group's vector after :func:`schedule`:
    the step count, the scheduled lr and the averaging coefficient
    ``c = k^r lr_max^weight_lr_power / weight_sum`` (0 while ``weight_sum`` is
    0), in the oracle's Python-float arithmetic."""
    v: List[float] = gs.tolist()
    k = v[0]
    weight = (k ** r) * (v[3] ** weight_lr_power)
    ckp1 = weight / v[2] if v[2] != 0.0 else 0.0
    return k, v[4], ckp1


def tensor_scalars(gs: Tensor, r: float, weight_lr_power: float, beta2: float, like: Tensor) -> Tensor:
    """``(lr, c, 1 - beta2^k)`` of :func:`step_scalars` as one tensor in
    ``like``'s dtype and on its device, with no host read (torch.compile)."""
    k = gs[0]
    weight = k ** r * gs[3] ** weight_lr_power
    ws = gs[2]
    ckp1 = torch.where(ws != 0.0, weight / torch.where(ws != 0.0, ws, 1.0), 0.0)
    return torch.stack([gs[4], ckp1, 1 - beta2 ** k]).to(like.device, like.dtype)


def _average_and_step(params: List[Tensor], zs: List[Tensor], grads: List[Tensor], lr: float, ckp1: float,
                      beta: float, scalars: Optional[Tensor]) -> None:
    # y moves towards z (the new average), then along the step; z takes the plain step
    if scalars is not None:
        lr_t, ckp1_t = scalars[0], scalars[1]
        torch._foreach_lerp_(params, zs, [ckp1_t for _ in params])
        torch._foreach_add_(params, torch._foreach_mul(grads, lr_t * (beta * (1 - ckp1_t) - 1)))
        torch._foreach_sub_(zs, torch._foreach_mul(grads, lr_t))
        return
    torch._foreach_lerp_(params, zs, ckp1)
    torch._foreach_add_(params, grads, alpha=lr * (beta * (1 - ckp1) - 1))
    torch._foreach_sub_(zs, grads, alpha=lr)


def sgd_schedulefree(
    params: List[Tensor],
    grads: List[Tensor],
    zs: List[Tensor],
    lr: float,
    ckp1: float,
    momentum: float,
    weight_decay: float,
    scalars: Optional[Tensor] = None,
) -> None:
    """Functional Schedule-Free SGD over aligned tensor lists, in place: the
    parameters hold ``y`` (train mode), ``zs`` the base iterates; ``lr`` and
    ``ckp1`` (``c``) are this step's (:func:`step_scalars`), or, as a tensor
    ``scalars`` (:func:`tensor_scalars`), under torch.compile.  Never writes
    into ``grads``' tensors."""
    if len(params) == 0:
        return
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    _average_and_step(params, zs, grads, lr, ckp1, momentum, scalars)


def adamw_schedulefree(
    params: List[Tensor],
    grads: List[Tensor],
    zs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    lr: float,
    ckp1: float,
    bias_correction2: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    scalars: Optional[Tensor] = None,
) -> None:
    """Functional Schedule-Free AdamW over aligned tensor lists, in place: the
    parameters hold ``y`` (train mode), ``zs`` the base iterates; ``lr``,
    ``ckp1`` (``c``) and ``bias_correction2`` (``1 - beta2^k``) are this
    step's (:func:`step_scalars`), or, as a tensor ``scalars``
    (:func:`tensor_scalars`), under torch.compile.  Never writes into
    ``grads``' tensors."""
    if len(params) == 0:
        return
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if scalars is not None:
        denom = torch._foreach_div(exp_avg_sqs, scalars[2])
    else:
        denom = torch._foreach_div(exp_avg_sqs, bias_correction2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    grads = torch._foreach_div(grads, denom)
    if weight_decay != 0:
        torch._foreach_add_(grads, params, alpha=weight_decay)  # decay at y
    _average_and_step(params, zs, grads, lr, ckp1, beta1, scalars)


def swap(params: List[Tensor], zs: List[Tensor], gs: Tensor, beta: float, train: bool) -> None:
    """Train mode (``y = lerp(x, z, 1 - beta)``) or eval mode
    (``x = lerp(y, z, 1 - 1/beta)``) of a param group's parameters that have
    state, in place; records the mode in ``gs``.  Nothing when the group is in
    that mode already."""
    on = float(gs[1]) != 0.0
    if on == train:
        return
    if len(params) > 0:
        torch._foreach_lerp_(params, zs, 1 - beta if train else 1 - 1 / beta)
    gs[1].fill_(1.0 if train else 0.0)


def _z(p: Tensor) -> Tensor:
    # a copy of the parameter (its value at the first gradient); ends with an in-place op,
    # so TorchScript never merges two of them (funcopt/optimizers/_common.py)
    return torch.empty_like(p, memory_format=torch.preserve_format).copy_(p)


class AdamWScheduleFreeKernel:
    """Schedule-Free AdamW for the shared core (slots: z, exp_avg_sq; the group vector last)."""

    def __init__(self) -> None:
        self.name = "AdamWScheduleFree"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [_z(p), torch.empty_like(p, memory_format=torch.preserve_format).zero_()]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def group(self, groups: List[Tensor], hs: List[Dict[str, float]]) -> None:
        schedule_all(groups, hs, self.name)

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        if len(params) == 0:
            return
        gs = state[len(state) - 1][0]
        beta2 = h["betas1"]
        if torch.compiler.is_compiling():  # no host reads
            sc = tensor_scalars(gs, h["r"], h["weight_lr_power"], beta2, params[0])
            adamw_schedulefree(params, grads, state[0], state[1], 0.0, 0.0, 1.0, h["betas0"], beta2, h["eps"],
                               h["weight_decay"], sc)
            return
        k, lr, ckp1 = step_scalars(gs, h["r"], h["weight_lr_power"])
        adamw_schedulefree(params, grads, state[0], state[1], lr, ckp1, 1 - beta2 ** k, h["betas0"], beta2,
                           h["eps"], h["weight_decay"])

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        # reached by no input (sparse gradients are refused, no differentiable option):
        # the per-tensor formula is the foreach formula over the same lists
        self.dense(params, grads, state, h, False, first, None, None)
        return state

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        swap(params, state[0], state[len(state) - 1][0], h["betas0"], train)

    def partial(self, groups: List[Tensor]) -> Tensor:
        return torch.empty(0, dtype=torch.float64)

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        pass


class SGDScheduleFreeKernel:
    """Schedule-Free SGD for the shared core (slot: z; the group vector last)."""

    def __init__(self) -> None:
        self.name = "SGDScheduleFree"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        return [_z(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        pass

    def group(self, groups: List[Tensor], hs: List[Dict[str, float]]) -> None:
        schedule_all(groups, hs, self.name)

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        if len(params) == 0:
            return
        gs = state[len(state) - 1][0]
        if torch.compiler.is_compiling():  # no host reads
            sc = tensor_scalars(gs, h["r"], h["weight_lr_power"], 0.0, params[0])
            sgd_schedulefree(params, grads, state[0], 0.0, 0.0, h["momentum"], h["weight_decay"], sc)
            return
        _, lr, ckp1 = step_scalars(gs, h["r"], h["weight_lr_power"])
        sgd_schedulefree(params, grads, state[0], lr, ckp1, h["momentum"], h["weight_decay"])

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        # reached by no input (sparse gradients are refused, no differentiable option):
        # the per-tensor formula is the foreach formula over the same lists
        self.dense(params, grads, state, h, False, first, None, None)
        return state

    def mode(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float], train: bool) -> None:
        swap(params, state[0], state[len(state) - 1][0], h["momentum"], train)

    def partial(self, groups: List[Tensor]) -> Tensor:
        return torch.empty(0, dtype=torch.float64)

    def combine(self, groups: List[Tensor], total: Tensor) -> None:
        pass


_GROUP_STATE = (("k", 0), ("train_mode", True), ("weight_sum", 0.0), ("lr_max", -1.0), ("scheduled_lr", 0.0))


def _refuse(msg: str, key: str, value: Any) -> None:
    raise ValueError(f"{msg} ({key}={value!r})")


def _check_sgd_ranges(group: Dict[str, Any]) -> None:
    """The oracle's own checks (``schedulefree.SGDScheduleFree``'s constructor, its
    words), the key and value appended; also on a param_groups edit and a load."""
    if "lr" in group and group["lr"] < 0.0:
        _refuse("Invalid learning rate: {}".format(group["lr"]), "lr", group["lr"])
    if "weight_decay" in group and group["weight_decay"] < 0.0:
        _refuse("Invalid weight_decay value: {}".format(group["weight_decay"]), "weight_decay", group["weight_decay"])
    if "momentum" in group and (group["momentum"] <= 0 or group["momentum"] >= 1):
        _refuse("Momentum must be between 0 and 1 exclusive: {}".format(group["momentum"]), "momentum",
                group["momentum"])


def _auto_despite_foreach(opt: Optimizer, impl: str) -> None:
    """The oracle's ``foreach`` defaults to True, which funcopt's base class
    reads as ``impl="foreach"``: here it chooses nothing (the oracle's two
    paths and funcopt's are the same numbers), so ``impl="auto"`` stays
    "auto" (cache-blocked on the CPU)."""
    if impl == "auto" and opt.impl == "foreach":
        opt.impl = "auto"
        opt._build_core({})


class _Modes:
    """What both Schedule-Free classes add to :class:`funcopt.Optimizer`:
    ``train()``/``eval()``, the eval-mode check before a step, and a new param
    group in the optimizer's current mode.  (A mixin: the TorchScript subset
    concerns the kernels, not these Python classes.)"""

    def train(self) -> None:
        """Train mode: the parameters hold ``y``, where gradients are taken
        (each group's ``train_mode`` set; nothing where it is already)."""
        self._set_mode(True)

    def eval(self) -> None:
        """Eval mode: the parameters hold the average ``x``, to evaluate or
        save the model (each group's ``train_mode`` cleared)."""
        self._set_mode(False)

    def step(self, grads: Any = None, grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
             closure: Any = None) -> Any:
        """One step, as :meth:`funcopt.Optimizer.step`; raises ``RuntimeError``
        in eval mode (before the closure runs and before anything changes),
        as the oracle does."""
        for group in self.param_groups:
            if not group.get("train_mode", False):
                raise RuntimeError(_eval_mode_error(type(self).__name__))
        return super().step(grads, grad_scale, found_inf, closure)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; a group that does not
        say its ``train_mode`` takes the optimizer's current mode (group 0's).
        (The oracle starts it in eval mode: its step checks group 0 only and
        steps the new group, but its ``eval()`` then skips it, leaving those
        parameters at ``y``.  A new group has no state, so either mode is
        the same parameters; this one is the one the next ``eval()`` honours.)"""
        if self.param_groups and isinstance(param_group, dict) and "train_mode" not in param_group:
            param_group = dict(param_group, train_mode=bool(self.param_groups[0].get("train_mode", False)))
        super().add_param_group(param_group)


class AdamWScheduleFree(_Modes, Optimizer):
    r"""Schedule-Free AdamW (Defazio et al. 2024) with a functional, scriptable
    step; the oracle is ``schedulefree.AdamWScheduleFree`` (same arguments,
    defaults, state and ``state_dict`` format).

    No learning-rate schedule is needed (``warmup_steps`` gives a linear
    warmup).  Call :meth:`train` before stepping and :meth:`eval` before
    evaluating the model or saving a checkpoint: they swap the parameters
    between the point where gradients are taken and the average (a step in
    eval mode raises).  A checkpoint restores the mode it was taken in.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``0.0025``).
      betas: ``(beta1, beta2)``: the interpolation between the average and
        the base iterate (``beta1``) and the decay of the second moment
        (default ``(0.9, 0.999)``).  As the oracle, no range is checked
        (``eval()`` divides by ``beta1``).
      eps: added to the denominator (default ``1e-8``).
      weight_decay: added to the normalized gradient as ``weight_decay * y``
        (default ``0``).
      warmup_steps: linear warmup of the lr over this many steps (default ``0``).
      r: the averaging weight of step ``k`` grows as ``k^r`` (default ``0``).
      weight_lr_power: the averaging weight also scales with
        ``max lr so far ^ weight_lr_power`` (default ``2``; ``0``: no weighting).
      foreach: the oracle's switch between its for-loop and foreach code
        (default ``True``), recorded in param_groups; both are the same
        numbers, and so is every ``impl`` of funcopt's.
      impl: ``"auto"`` (the foreach formula, cache-blocked on the CPU) or
        ``"foreach"`` (one foreach call sequence per bucket, the oracle's);
        there is no fused kernel.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.AdamWScheduleFree([w], lr=0.1)
        >>> opt.train()
        >>> opt.step([torch.tensor([1.0, -1.0])])
        >>> w
        tensor([0.9000, 1.1000], requires_grad=True)
        >>> opt.param_groups[0]["k"], opt.state[w]["z"]
        (1, tensor([0.9000, 1.1000]))
        >>> opt.step([torch.tensor([1.0, -1.0])])
        >>> w  # y, where the gradients are taken
        tensor([0.8450, 1.1550], requires_grad=True)
        >>> opt.eval()  # x, the average: to evaluate or save
        >>> w
        tensor([0.8500, 1.1500], requires_grad=True)
        >>> opt.step([torch.ones(2)])
        Traceback (most recent call last):
          ...
        RuntimeError: funcopt: AdamWScheduleFree is in eval mode: call optimizer.train() before step() (and optimizer.eval() before evaluating or saving the model)
        >>> opt.train()  # back to y
        >>> w
        tensor([0.8450, 1.1550], requires_grad=True)
    """

    torch_class = "schedulefree:AdamWScheduleFree"
    complex_differs_from_oracle = True  # real views, as torch.optim (the oracle squares a complex g)
    kernel_class = AdamWScheduleFreeKernel
    sparse_msg = "AdamWScheduleFree does not support sparse gradients"
    slots = (("z", None), ("exp_avg_sq", None))
    fused_devices = ()
    group_state = _GROUP_STATE
    has_modes = True

    def __init__(self, params: Any, lr: Any = 0.0025, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, warmup_steps: int = 0, r: float = 0.0, weight_lr_power: float = 2.0,
                 foreach: Optional[bool] = hasattr(torch, "_foreach_mul_"), *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, r=r, k=0, warmup_steps=warmup_steps,
                                      train_mode=True, weight_sum=0.0, lr_max=-1.0, scheduled_lr=0.0,
                                      weight_lr_power=weight_lr_power, weight_decay=weight_decay,
                                      foreach=foreach), impl)
        _auto_despite_foreach(self, impl)


class SGDScheduleFree(_Modes, Optimizer):
    r"""Schedule-Free SGD (Defazio et al. 2024) with a functional, scriptable
    step; the oracle is ``schedulefree.SGDScheduleFree`` (same arguments,
    defaults, state and ``state_dict`` format).

    No learning-rate schedule is needed (``warmup_steps`` gives a linear
    warmup).  Call :meth:`train` before stepping and :meth:`eval` before
    evaluating the model or saving a checkpoint: they swap the parameters
    between the point where gradients are taken and the average (a step in
    eval mode raises).  A checkpoint restores the mode it was taken in.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``1.0``).
      momentum: the interpolation between the average and the base iterate,
        in ``(0, 1)`` (default ``0.9``).
      weight_decay: L2 penalty, ``g += weight_decay * y`` (default ``0``).
      warmup_steps: linear warmup of the lr over this many steps (default ``0``).
      r: the averaging weight of step ``k`` grows as ``k^r`` (default ``0``).
      weight_lr_power: the averaging weight also scales with
        ``max lr so far ^ weight_lr_power`` (default ``2``; ``0``: no weighting).
      foreach: the oracle's switch between its for-loop and foreach code
        (default ``True``), recorded in param_groups; both are the same
        numbers, and so is every ``impl`` of funcopt's.
      impl: ``"auto"`` (the foreach formula, cache-blocked on the CPU) or
        ``"foreach"`` (one foreach call sequence per bucket, the oracle's);
        there is no fused kernel.

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.SGDScheduleFree([w], lr=0.5, momentum=0.5)
        >>> opt.train()
        >>> for _ in range(2):
        ...     opt.step([torch.tensor([1.0, -1.0])])
        >>> w  # y, where the gradients are taken
        tensor([0.1250, 1.8750], requires_grad=True)
        >>> opt.eval()  # x, the average: to evaluate or save
        >>> w
        tensor([0.2500, 1.7500], requires_grad=True)
        >>> opt.param_groups[0]["train_mode"], opt.state[w]["z"]
        (False, tensor([0., 2.]))
    """

    torch_class = "schedulefree:SGDScheduleFree"
    kernel_class = SGDScheduleFreeKernel
    sparse_msg = "SGDScheduleFree does not support sparse gradients"
    slots = (("z", None),)
    fused_devices = ()
    group_state = _GROUP_STATE
    has_modes = True
    check_ranges = staticmethod(_check_sgd_ranges)

    def __init__(self, params: Any, lr: Any = 1.0, momentum: float = 0.9, weight_decay: float = 0,
                 warmup_steps: int = 0, r: float = 0.0, weight_lr_power: float = 2,
                 foreach: Optional[bool] = hasattr(torch, "_foreach_mul_"), *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, r=r, k=0, warmup_steps=warmup_steps,
                                      train_mode=True, weight_sum=0.0, lr_max=-1.0, scheduled_lr=0.0,
                                      weight_lr_power=weight_lr_power, weight_decay=weight_decay,
                                      foreach=foreach), impl)
        _auto_despite_foreach(self, impl)

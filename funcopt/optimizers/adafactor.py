r"""Adafactor (Shazeer & Stern 2018, as ``torch.optim.Adafactor``).

Update rule for each parameter :math:`p` with gradient :math:`g` at step
:math:`t` (``maximize`` negates :math:`g`; ``eps1`` defaults to the dtype's
machine epsilon; RMS(x) = ||x||_2 / sqrt(numel(x)))::

    w_t    = t^beta2_decay                        # 1 - beta2_t
    rho_t  = min(lr, 1 / sqrt(t))
    alpha  = max(eps2, RMS(p)) * rho_t            # before the decay below
    p     *= 1 - lr * weight_decay
    # p.dim() > 1: factored second moment over the last two dimensions
    R_t    = lerp(R_{t-1}, mean(g * g, dim=-1), w_t)        # row_var
    C_t    = lerp(C_{t-1}, mean(g * g, dim=-2), w_t)        # col_var
    V      = R_t @ C_t / max(mean(R_t, dim=-2), eps1)
    # otherwise
    V      = variance_t = lerp(variance_{t-1}, g * g, w_t)
    u      = g / sqrt(max(V, eps1^2))
    p     -= alpha / max(1, RMS(u) / d) * u

State (torch's format): ``step``, then ``row_var`` and ``col_var`` (shaped like
the parameter with the last, resp. second-to-last, dimension 1) for a
parameter of two or more dimensions, ``variance`` (like the parameter)
otherwise.  Complex parameters and sparse gradients are refused with torch's
errors.  The rule needs each parameter whole, so ZeRO places Adafactor's
parameters whole (``partition="greedy"``).
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import scalars, step_tensor, step_values, zeros_like


def _machine_eps(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).eps`` (TorchScript has no ``finfo``)."""
    if dtype == torch.float64:
        return 2.220446049250313e-16
    if dtype == torch.float16:
        return 0.0009765625
    if dtype == torch.bfloat16:
        return 0.0078125
    return 1.1920928955078125e-07


def _norm(t: Tensor) -> Tensor:
    """``t.norm(2)`` (torch.norm's dispatch for p=2 over every dimension)."""
    return torch.linalg.vector_norm(t, 2.0, None, False)


def _line_norm(t: Tensor, dim: int) -> Tensor:
    """``torch.norm(t, dim=dim, keepdim=True)`` (torch.norm's dispatch for "fro" over one dim)."""
    return torch.linalg.vector_norm(t, 2.0, [dim], True)


def _norms(ts: List[Tensor]) -> List[float]:
    """``[float(t.norm(2)) for t in ts]`` with one host read; on CPU one ``torch._foreach_norm``
    (there a loop of the same ``linalg_vector_norm`` per tensor, so the same numbers; other
    devices' multi-tensor kernel reduces in another order, so there: one norm per tensor)."""
    if len(ts) == 0:
        return []
    if ts[0].device.type == "cpu":
        norms = torch._foreach_norm(ts, 2.0)
    else:
        norms = [_norm(x) for x in ts]
    return torch.jit.annotate(List[float], torch.stack(norms).double().tolist())


def _col_norm(g: Tensor) -> Tensor:
    """``torch.norm(g, dim=-2, keepdim=True)``, bitwise, without its slow path.

    On a contiguous CPU tensor the norm over dim -2 is an outer reduction: ATen
    runs its generic reduce, one sub-iterator per output element walking the
    column with a stride of a whole row (7 ms for a 2048 x 512 float32 matrix,
    60 ms for 4096 x 1024: 60x the row norm, and most of an Adafactor step).
    Its arithmetic per column is plain and sequential: ``acc = acc + x * x``
    over the rows in order, from 0, in float32 (no FMA), then ``std::sqrt``.
    The same numbers here: ``g * g`` (one pass), then ``index_add_`` of every
    row into one row of zeros -- ATen's loop adds row after row in order with
    one reused iterator (an elementwise add per row, vectorized over the
    columns) -- then the square root in float64 rounded to float32 (correctly
    rounded, as ``std::sqrt``; torch's vectorized float32 ``sqrt`` is not).
    Anything else (another dtype or device, a strided layout, whose reduction
    ATen orders differently, a dimension of size 1) takes torch's own call.
    ``tests/optimizers/test_adafactor.py`` checks the equality."""
    return _col_norm_buf(g)[0]


def _col_norm_buf(g: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`_col_norm`, and the scratch tensor shaped like ``g`` it used (``None``
    where it took torch's call): a caller may write into it, saving an allocation."""
    if (g.dtype != torch.float32 or g.device.type != "cpu" or g.dim() < 2 or g.size(-1) < 2
            or g.size(-2) < 2 or not g.is_contiguous()):
        return _line_norm(g, -2), None
    shape = list(g.shape)
    shape[-2] = 1
    acc = torch.zeros(shape, dtype=g.dtype, device=g.device)
    rows = torch.zeros([g.size(-2)], dtype=torch.long, device=g.device)
    sq = g * g
    if g.dim() == 2:
        # as (1, R, C): index_add_ over dim 0 (or the last) would go through scatter_add_
        acc.unsqueeze(0).index_add_(1, rows, sq.unsqueeze(0))
    else:
        acc.index_add_(g.dim() - 2, rows, sq)
    return acc.double().sqrt_().to(torch.float32), sq


def adafactor(
    params: List[Tensor],
    grads: List[Tensor],
    row_vars: List[Tensor],
    col_vars: List[Tensor],
    variances: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta2_decay: float,
    eps1: Optional[float],
    eps2: float,
    d: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Functional Adafactor over aligned tensor lists of one device and dtype,
    updated in place; ``steps`` already bumped for this step.

    ``row_vars``/``col_vars`` hold empty tensors for parameters of fewer than
    two dimensions, ``variances`` for the others.  ``torch._foreach_*`` ops in
    the order of torch's foreach implementation, per tensor the same
    arithmetic, so results are bitwise equal to
    ``torch.optim.Adafactor(foreach=True)``.  torch steps matrices and vectors
    as two lists; here both go through one pass (an op that concerns only one
    kind runs on the other's empty placeholder state, a no-op), because
    TorchScript drops in-place foreach writes into freshly built sub-lists
    (see :mod:`funcopt._slots`).  ``eps1=None``: the dtype's machine epsilon
    (torch takes it from the first dtype of a param group, so a group mixing
    dtypes differs there).
    """
    if len(params) == 0:
        return
    if eps1 is None:
        eps1 = _machine_eps(params[0].dtype)
    multi = [g.dim() > 1 for g in grads]
    any_multi = False
    any_vec = False
    for m in multi:
        any_multi = any_multi or m
        any_vec = any_vec or not m
    if maximize:
        grads = torch._foreach_neg(grads)
    if torch.compiler.is_compiling():
        _adafactor_compiled(params, grads, row_vars, col_vars, variances, steps, multi, lr, beta2_decay,
                            eps1, eps2, d, weight_decay)
        return
    t = step_values(steps)
    if _per_tensor(params):
        for j in range(len(params)):
            _adafactor_one(params[j], grads[j], row_vars[j], col_vars[j], variances[j], t[j], multi[j], lr,
                           beta2_decay, eps1, eps2, d, weight_decay, False)
        return
    weights = scalars([s ** beta2_decay for s in t])
    alphas: List[float] = []
    p_norms = _norms(params)
    for j in range(len(params)):
        rho = min(lr, 1 / (t[j] ** 0.5))
        alphas.append(max(eps2, p_norms[j] / (params[j].numel() ** 0.5)) * rho)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    if any_multi:
        # vectors: their (empty) row_var / col_var stands in for the mean
        row_means = [_line_norm(grads[j], -1) if multi[j] else row_vars[j] for j in range(len(grads))]
        torch._foreach_mul_(row_means, row_means)
        torch._foreach_div_(row_means, scalars([float(g.size(-1)) if g.dim() > 1 else 1.0 for g in grads]))
        torch._foreach_lerp_(row_vars, row_means, weights)
        col_means = [_col_norm(grads[j]) if multi[j] else col_vars[j] for j in range(len(grads))]
        torch._foreach_mul_(col_means, col_means)
        torch._foreach_div_(col_means, scalars([float(g.size(-2)) if g.dim() > 1 else 1.0 for g in grads]))
        torch._foreach_lerp_(col_vars, col_means, weights)
    if any_vec:
        if any_multi:
            grads_squared = [grads[j] * grads[j] if not multi[j] else variances[j] for j in range(len(grads))]
        else:
            grads_squared = torch._foreach_mul(grads, grads)
        torch._foreach_lerp_(variances, grads_squared, weights)
    if any_multi:
        var_estimates: List[Tensor] = []
        for j in range(len(grads)):
            if multi[j]:
                v = torch.matmul(row_vars[j], col_vars[j])
                v.div_(row_vars[j].mean([-2], True).clamp_min_(eps1))
                var_estimates.append(v.clamp_min_(eps1 * eps1))
            else:
                var_estimates.append(torch.clamp_min(variances[j], eps1 * eps1))  # = clone, then clamp_min_
    else:
        var_estimates = torch._foreach_clamp_min(variances, eps1 * eps1)
    torch._foreach_rsqrt_(var_estimates)
    torch._foreach_mul_(var_estimates, grads)
    updates = var_estimates
    scales: List[float] = []
    u_norms = _norms(updates)
    for j in range(len(updates)):
        scales.append(-alphas[j] / max(1.0, u_norms[j] / ((updates[j].numel() ** 0.5) * d)))
    torch._foreach_mul_(updates, scalars(scales))
    torch._foreach_add_(params, updates)


def _per_tensor(params: List[Tensor]) -> bool:
    """Step tensor by tensor (:func:`_adafactor_one`) rather than op by op over the
    list: on CPU, where the foreach ops are themselves loops over the tensors
    (the same per-tensor kernels, so the same numbers), once a tensor is large
    enough (64K elements) that keeping it in cache across its ~10 passes pays
    for the per-tensor dispatch."""
    if params[0].device.type != "cpu":
        return False
    for p in params:
        if p.numel() >= 65536:
            return True
    return False


def _adafactor_one(p: Tensor, g: Tensor, row_var: Tensor, col_var: Tensor, variance: Tensor, t: float,
                   multi: bool, lr: float, beta2_decay: float, eps1: float, eps2: float, d: float,
                   weight_decay: float, fma_update: bool) -> None:
    """One tensor's step: the ops of torch's foreach implementation for this
    tensor, in its order (each ``torch._foreach_*`` op on CPU runs the per-tensor
    op used here), so the numbers are the same; all passes over one tensor
    run back to back while it is in cache.  ``g`` already negated for maximize.
    ``fma_update``: the last update as torch's for-loop writes it,
    ``p.add_(u, alpha=scale)`` (one rounding), instead of the foreach
    ``u.mul_(scale); p.add_(u)``; everything before it is the same op for op."""
    w = t ** beta2_decay
    rho = min(lr, 1 / (t ** 0.5))
    alpha = max(eps2, float(_norm(p).item()) / (p.numel() ** 0.5)) * rho
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    if multi:
        row_mean = _line_norm(g, -1)
        row_mean.mul_(row_mean)
        row_mean.div_(float(g.size(-1)))
        row_var.lerp_(row_mean, w)
        col_mean, buf = _col_norm_buf(g)
        col_mean.mul_(col_mean)
        col_mean.div_(float(g.size(-2)))
        col_var.lerp_(col_mean, w)
        if buf is None:
            v = torch.matmul(row_var, col_var)
        else:
            v = torch.matmul(row_var, col_var, out=buf)
        v.div_(row_var.mean([-2], True).clamp_min_(eps1))
    else:
        variance.lerp_(g * g, w)
        v = variance.clone()
    v.clamp_min_(eps1 * eps1)
    v.rsqrt_()
    v.mul_(g)
    scale = -alpha / max(1.0, float(_norm(v).item()) / ((v.numel() ** 0.5) * d))
    if fma_update:
        p.add_(v, alpha=scale)
    else:
        v.mul_(scale)
        p.add_(v)


def _adafactor_compiled(ps: List[Tensor], gs: List[Tensor], rvs: List[Tensor], cvs: List[Tensor],
                        vs: List[Tensor], ss: List[Tensor], multi: List[bool], lr: float, beta2_decay: float,
                        eps1: float, eps2: float, d: float, weight_decay: float) -> None:
    """The same rule under ``torch.compile``: per-step scalars as 0-d tensors (no
    host reads), so the graph has no breaks; equal to eager to rounding."""
    weights: List[Tensor] = []
    alphas: List[Tensor] = []
    for j in range(len(ps)):
        p = ps[j]
        s = ss[j].to(device=p.device, dtype=p.dtype)
        weights.append(torch.pow(s, beta2_decay))
        rho = torch.clamp(torch.rsqrt(s), None, lr)
        alphas.append(torch.clamp(_norm(p) / (p.numel() ** 0.5), eps2, None) * rho)
    if weight_decay != 0:
        torch._foreach_mul_(ps, 1 - lr * weight_decay)
    for j in range(len(ps)):
        g = gs[j]
        if multi[j]:
            rvs[j].lerp_(_line_norm(g, -1).square() / g.size(-1), weights[j])
            cvs[j].lerp_(_line_norm(g, -2).square() / g.size(-2), weights[j])
            v = torch.matmul(rvs[j], cvs[j]) / rvs[j].mean([-2], True).clamp_min(eps1)
        else:
            vs[j].lerp_(g * g, weights[j])
            v = vs[j].clone()
        u = v.clamp_min(eps1 * eps1).rsqrt() * g
        denom = torch.clamp(_norm(u) / ((u.numel() ** 0.5) * d), 1.0, None)
        ps[j].add_(u * (-alphas[j] / denom))


def adafactor_single(
    params: List[Tensor],
    grads: List[Tensor],
    row_vars: List[Tensor],
    col_vars: List[Tensor],
    variances: List[Tensor],
    steps: List[Tensor],
    lr: float,
    beta2_decay: float,
    eps1: Optional[float],
    eps2: float,
    d: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """torch's per-tensor formula (``foreach=False``), ``steps`` already bumped: the
    foreach formula's per-tensor step (:func:`_adafactor_one`) but for the last
    update, which torch's for-loop writes with one rounding."""
    for i in range(len(params)):
        grad = grads[i] if not maximize else -grads[i]
        e1 = _machine_eps(params[i].dtype) if eps1 is None else eps1
        _adafactor_one(params[i], grad, row_vars[i], col_vars[i], variances[i], float(steps[i].item()),
                       grad.dim() > 1, lr, beta2_decay, e1, eps2, d, weight_decay, True)


def _eps1(h: Dict[str, float]) -> Optional[float]:
    e = h["eps0"]
    return None if math.isnan(e) else e  # NaN: eps=(None, ...)


class AdafactorKernel:
    """Adafactor for the shared core (slots: step, row_var, col_var, variance)."""

    def __init__(self) -> None:
        self.name = "Adafactor"

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        if p.dim() > 1:
            row_shape = list(p.shape)
            row_shape[-1] = 1
            col_shape = list(p.shape)
            col_shape[-2] = 1
            return [step_tensor(p, fused), p.new_zeros(row_shape), p.new_zeros(col_shape), torch.empty(0)]
        return [step_tensor(p, fused), torch.empty(0), torch.empty(0), zeros_like(p)]

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        for i in idx:
            if params[i].is_complex():
                raise RuntimeError("Adafactor does not support complex parameters")
        for i in idx:
            if params[i].numel() == 0:
                raise ValueError(
                    "funcopt: parameter " + str(i) + " has no elements: Adafactor divides by its RMS "
                    "(torch.optim.Adafactor fails on it with ZeroDivisionError)")

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        adafactor(params, grads, state[1], state[2], state[3], state[0], h["lr"], h["beta2_decay"],
                  _eps1(h), h["eps1"], h["d"], h["weight_decay"], h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        # not reached by the core (no sparse gradients, no differentiable=True): torch's
        # per-tensor formula, for callers of the kernel
        adafactor_single(params, grads, state[1], state[2], state[3], state[0], h["lr"], h["beta2_decay"],
                         _eps1(h), h["eps1"], h["d"], h["weight_decay"], h["maximize"] != 0.0)
        return state


class Adafactor(Optimizer):
    r"""Adafactor, as ``torch.optim.Adafactor``, with a functional, scriptable step.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: maximum relative step size and the weight-decay scale (default ``1e-2``).
      beta2_decay: exponent of the second-moment weight ``t^beta2_decay`` (default ``-0.8``).
      eps: ``(eps1, eps2)``: ``eps1`` floors the second moment (``None``: the
        dtype's machine epsilon), ``eps2`` floors the parameter RMS (default ``(None, 1e-3)``).
      d: update clipping threshold on RMS(update) (default ``1.0``).
      weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay`` (default ``0.0``).
      foreach: accepted and recorded (funcopt always runs the foreach formula).
      maximize: ascend instead of descend (default ``False``).
      impl: ``"auto"`` or ``"foreach"`` (torch has no fused Adafactor).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, 2, requires_grad=True)
        >>> opt = funcopt.Adafactor([w], lr=0.01)
        >>> opt.step([torch.ones(2, 2)])
        >>> w
        tensor([[0.9900, 0.9900],
                [0.9900, 0.9900]], requires_grad=True)
        >>> sorted(opt.state[w])
        ['col_var', 'row_var', 'step']
    """

    torch_class = torch.optim.Adafactor
    kernel_class = AdafactorKernel
    sparse_msg = "Adafactor does not support sparse gradients"
    slots = (("step", None), ("row_var", None), ("col_var", None), ("variance", None))
    whole_params = True

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Any = None) -> Optional[Tuple[int, ...]]:
        """Factored state: ``row_var``/``col_var`` for parameters of 2 or more
        dimensions (the last dimension, resp. the one before it, reduced),
        ``variance`` otherwise; ``None`` for the slots ``p`` does not have."""
        shape = tuple(p.shape)
        if name == "step":
            return ()
        if name == "variance":
            return shape if p.dim() <= 1 else None
        if p.dim() <= 1:
            return None
        k = -1 if name == "row_var" else -2
        out = list(shape)
        out[k] = 1
        return tuple(out)

    def __init__(self, params: Any, lr: Any = 1e-2, beta2_decay: float = -0.8,
                 eps: Tuple[Optional[float], float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0,
                 *, foreach: Optional[bool] = None, maximize: bool = False, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                      foreach=foreach, maximize=maximize), impl)

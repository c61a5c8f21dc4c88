r"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam",
arXiv:2409.11321), as ``pytorch_optimizer.SOAP``: Adam run in the eigenbasis of
Shampoo's preconditioner.

For each parameter :math:`p` with gradient :math:`g` (``maximize`` negates
:math:`g`) seen as a tensor of ``k`` dimensions (its own, or with ``merge_dims``
small neighbouring dimensions merged, ``pytorch_optimizer``'s ``merge_small_dims``;
a vector: one dimension, preconditioned only with ``precondition_1d``), each
dimension ``i`` of size at most ``max_precondition_dim`` has a factor ``GG_i``
(``n_i x n_i``) and an orthogonal basis ``Q_i``; ``proj(x)`` contracts each
dimension ``i`` of ``x`` with ``Q_i`` (``proj'``: with ``Q_i^T``), a dimension
without a factor is left as it is.  ``t`` is the group's step counter
(``group['step']``), ``s = t - 1``::

    first gradient of p:   GG_i = lerp(0, g_(i) g_(i)^T, 1 - shampoo_beta)   # g_(i): dims but i contracted
                           Q_i  = eigenvectors of GG_i + 1e-30 I, by decreasing eigenvalue
                           (and the basis refresh below if s > 0 and s % precondition_frequency == 0)
    t == 1:                nothing else (the group's first step only builds the preconditioner)
    otherwise:
        m   = lerp(m, g, 1 - beta1)                              # exp_avg, in p's basis
        v   = lerp(v, proj(g)^2, 1 - beta2)                      # exp_avg_sq, in the eigenbasis
        u   = proj'(proj(m) / (sqrt(v) + eps))
        u  /= sqrt(mean(u^2)) + eps                              # normalize_gradient only
        p  -= lr * sqrt(1 - beta2^s) / (1 - beta1^s) * u         # correct_bias (else lr * u)
        p  *= 1 - lr * weight_decay
        GG_i = lerp(GG_i, g_(i) g_(i)^T, 1 - shampoo_beta)
        if s > 0 and s % precondition_frequency == 0:           # basis refresh, one power step
            P   = GG_i @ Q_i, columns sorted by decreasing diag(Q_i^T P) (v's dimension i
                  permuted alike);  Q_i = QR(P).Q  (computed in float32, as the oracle)

``shampoo_beta`` (``None``: ``beta2``) and ``precondition_frequency`` are read
from the group when a parameter's state is created and kept in its state, as
the oracle does.  ``data_format="channels_last"`` reads a 4-D parameter as NHWC
when merging dimensions.

**State.**  ``opt.state[p]`` and ``state_dict()`` hold the oracle's entries:
``exp_avg``, ``exp_avg_sq`` (shaped like ``p``), ``GG`` and ``Q`` (lists, one
``n x n`` tensor or ``[]`` per dimension), ``precondition_frequency`` (int) and
``shampoo_beta`` (float); ``param_groups`` keep ``step``.  State dicts load both
ways with ``pytorch_optimizer.SOAP``.  Inside, the lists are fixed slots (one
per possible dimension, up to :data:`MAX_ORDER`; empty tensors where absent;
a ``dims`` slot records how many entries the lists have).  Replacing an
element of a live ``GG``/``Q`` list in place is not seen by the next step
(assign a new list, or edit the tensors in place, which is seen).

**Differences from the oracle** (each where the oracle fails or cannot be
matched):

* ``maximize`` and ``data_format`` are attributes of the oracle's instance;
  here they are group hyperparameters (``param_groups``, changeable per group,
  and seen by ZeRO and the RPC optimizer).  ``state_dict()`` leaves them out of
  a group where they equal the constructor's (and ``step`` while it is 0, as
  the oracle adds it at its first step); a loaded group without them takes the
  constructor's -- the oracle's rule.  A group with its own value keeps it
  through a save and load here; the oracle ignores the key.
* The oracle negates ``p.grad`` in place for ``maximize``; funcopt never writes
  the gradients.
* With ``merge_dims=True`` the oracle's ``merge_small_dims`` turns a shape
  whose elements all fit in one merged dimension (at most
  ``max_precondition_dim`` elements, other than exactly one) into ``[1]`` and its
  reshape fails (``shape '[1]' is invalid``), for a vector at its second step,
  otherwise at its first.  funcopt refuses such a parameter with a clear error
  at its first step, before anything changes.
* Parameters of more than :data:`MAX_ORDER` (preconditioned) dimensions are
  refused (the fixed slots).
* The oracle retries a failed float32 ``eigh`` in float64; the eager step here
  does too, the scripted and compiled steps do not (TorchScript has no
  ``try``).
* ``merge_dims``, ``max_precondition_dim``, ``precondition_1d`` and
  ``data_format`` are read afresh at every step, as the oracle does: a factor
  they no longer give is kept (used and refreshed, no longer accumulated), the
  same numbers.  Where they give a dimension a factor it does not have, or
  another preconditioned shape, the oracle fails mid-step; funcopt refuses the
  step before anything changes (:func:`state_problem`), and a state dict that
  the group's options cannot step at load.
* A tensor ``lr``: the oracle multiplies it in place by the bias correction at
  every step (``step_size = group['lr']; step_size *= ...``), so its learning
  rate compounds; funcopt steps with the tensor's value.

**Numerics.**  The eager and scripted steps run the oracle's operations in its
order on tensors laid out as the oracle's (the moments take the layout of the
parameter's first gradient, ``exp_avg_sq`` and the bases that of ``eigh``/QR's
results, loaded state its saved layout: the matrix products round by layout),
so they are bitwise equal to ``pytorch_optimizer.SOAP``.  That matters more
than usual: the first eigenbasis of a rank-deficient factor (a dimension larger
than the product of the others, as a non-square matrix's larger side; a vector
with ``precondition_1d``) is arbitrary within its null space, so a last-bit
change of a gradient moves SOAP -- the oracle too -- by about 1% within ten
steps.  Under ``torch.compile`` the group's step counter stays a tensor (the
first step and the refresh through ``torch.where``/``torch.cond``, no graph
break): equal to eager to rounding.

The rule needs each parameter whole, so ZeRO places SOAP's parameters whole
(``partition="greedy"``).  Complex parameters and sparse gradients are refused
with the oracle's words.
"""
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ..base import Optimizer
from ._common import zeros_like
from ._core import StepCounter
from .adopt import fill_instance_keys, strip_instance_keys

# most (preconditioned) dimensions per parameter: one GG and one Q slot each
MAX_ORDER = 8
# data_format -> the float the scripted core sees
DATA_FORMAT_CODES = {"channels_first": 0.0, "channels_last": 1.0}
# slot columns: exp_avg, exp_avg_sq, GG0..GG{MAX_ORDER-1}, Q0..Q{MAX_ORDER-1},
# precondition_frequency, shampoo_beta
_GG = 2
_Q = _GG + MAX_ORDER
_FREQ = _Q + MAX_ORDER
_BETA = _FREQ + 1
_DIMS = _BETA + 1  # the preconditioned shape (one entry per GG/Q list entry: their count, the oracle's len(GG))
_NUM_SLOTS = _DIMS + 1
_LAYOUT = (MAX_ORDER, _GG, _Q, _FREQ, _BETA, _DIMS)  # SOAPKernel's attributes repeat these


def merge_small_dims(shape: List[int], max_dim: int) -> List[int]:
    """``pytorch_optimizer``'s ``merge_small_dims``: neighbouring dimensions merged
    while their product stays at most ``max_dim``; a single merged dimension
    comes back as ``[1]`` (the oracle's rule, even where it has more elements)."""
    merged: List[int] = []
    product = 1
    for d in shape:
        product *= d
        if product > max_dim:
            merged.append(product // d)
            product = d
    merged.append(product)
    if len(merged) > 1:
        return merged
    return [1]


def _numel(shape: List[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _channels_first(shape: List[int]) -> List[int]:
    return [shape[0], shape[3], shape[1], shape[2]]


def factor_shape(shape: List[int], merge: bool, max_dim: int, channels_last: bool) -> List[int]:
    """The shape whose dimensions get a factor each: ``shape`` (a vector's too), or
    with ``merge`` its merged shape (a 4-D ``channels_last`` shape read as NHWC)."""
    if len(shape) == 1 or not merge:
        return shape
    if channels_last and len(shape) == 4:
        shape = _channels_first(shape)
    return merge_small_dims(shape, max_dim)


def factor_sizes(shape: List[int], merge: bool, max_dim: int, precondition_1d: bool,
                 channels_last: bool) -> List[int]:
    """One entry per dimension of :func:`factor_shape`: its size where it has a
    factor ``GG`` (``n x n``; ``n`` may be 0), -1 where it has none."""
    out: List[int] = []
    if len(shape) == 1:
        n = shape[0]
        out.append(n if precondition_1d and n <= max_dim else -1)
        return out
    for n in factor_shape(shape, merge, max_dim, channels_last):
        out.append(n if n <= max_dim else -1)
    return out


def state_problem(shape: List[int], order: int, sizes: List[int], merge: bool, max_dim: int,
                  precondition_1d: bool, channels_last: bool) -> str:
    """Why a parameter's stored preconditioner (``order`` entries; ``sizes[k]``: factor
    ``k``'s size, -1 where it has none) cannot be stepped under the group's options
    ("" where it can).  The oracle reads the options afresh at every step: a
    factor the options no longer give is kept as it is (used, refreshed, no longer
    accumulated); a dimension without a factor that the options now give one
    fails in the oracle (``[].lerp_``), and so does a changed preconditioned shape
    (``merge_dims``, ``data_format``, or a ``max_precondition_dim`` that merges
    otherwise)."""
    dims = factor_shape(shape, merge, max_dim, channels_last)
    if len(dims) != order:
        return ("its state preconditions " + str(order) + " dimensions, the group's merge_dims, "
                "max_precondition_dim and data_format give " + str(dims))
    for k in range(order):
        if sizes[k] >= 0 and sizes[k] != dims[k]:
            return ("its factor GG[" + str(k) + "] is " + str(sizes[k]) + " x " + str(sizes[k]) + ", the group's "
                    "merge_dims, max_precondition_dim and data_format give that dimension " + str(dims[k]))
        if sizes[k] < 0 and dims[k] <= max_dim and (len(shape) != 1 or precondition_1d):
            return ("its dimension " + str(k) + " has no factor GG and the group's max_precondition_dim/"
                    "precondition_1d now give it one (pytorch_optimizer.SOAP fails there: its GG entry is [])")
    return ""


def _stored_sizes(ggs: List[Tensor], order: int) -> List[int]:
    out: List[int] = []
    for k in range(order):
        out.append(ggs[k].size(0) if ggs[k].dim() == 2 else -1)
    return out


def _merge(x: Tensor, merge: bool, max_dim: int, channels_last: bool) -> Tensor:
    """``x`` as the preconditioner sees it (the oracle's ``merge_dims``).  A vector
    is left as it is: the oracle's reshape of one (to ``[1, n]``, ``n`` above
    ``max_precondition_dim``, or ``[1]``) changes no value of any result."""
    if not merge or x.dim() == 1:
        return x
    if channels_last and x.dim() == 4:
        x = x.permute([0, 3, 1, 2])
    return x.reshape(merge_small_dims(list(x.shape), max_dim))


def _unmerge(x: Tensor, shape: List[int], merge: bool, channels_last: bool) -> Tensor:
    if not merge or len(shape) == 1:
        return x
    if channels_last and len(shape) == 4:
        return x.reshape(_channels_first(shape)).permute([0, 2, 3, 1])
    return x.reshape(shape)


def _project(x: Tensor, qs: List[Tensor], order: int, forward: bool) -> Tensor:
    """Contract each of the ``order`` dimensions of ``x`` with its basis (``forward``:
    ``Q``'s rows, else its columns); a dimension without one moves to the end
    as it is."""
    other = 0 if forward else 1
    for k in range(order):
        q = qs[k]
        if q.numel() > 0:
            x = torch.tensordot(x, q, dims=([0], [other]))
        else:
            perm: List[int] = []
            for j in range(1, x.dim()):
                perm.append(j)
            perm.append(0)
            x = x.permute(perm)
    return x


def _admitted(ggs: List[Tensor], order: int, dims: List[int], max_dim: int, one_d: bool,
              precondition_1d: bool) -> List[bool]:
    """Which factors accumulate: those the parameter has and the options still give."""
    out: List[bool] = []
    for k in range(order):
        out.append(ggs[k].dim() == 2 and dims[k] <= max_dim and (not one_d or precondition_1d))
    return out


def _accumulate(g: Tensor, ggs: List[Tensor], order: int, weight: float, admit: List[bool]) -> None:
    """``GG_i = lerp(GG_i, g_(i) g_(i)^T, weight)`` for every admitted factor of the merged ``g``."""
    if g.dim() == 1:
        if admit[0]:
            ggs[0].lerp_(g.unsqueeze(1) @ g.unsqueeze(0), weight)
        return
    for k in range(order):
        if admit[k]:
            dims: List[int] = []
            for j in range(order):
                if j != k:
                    dims.append(j)
            ggs[k].lerp_(torch.tensordot(g, g, dims=(dims, dims)), weight)


def _layout_like(t: Tensor, like: Tensor) -> None:
    """Give state tensor ``t`` (whose values are about to be overwritten, or zeros) the
    strides ``like`` would pass on to ``torch.zeros_like``: the oracle's moments take
    the first gradient's layout and ``exp_avg_sq`` the refresh's result's, and the
    projections' matrix products round by layout.  ``t`` owns a dense storage of its
    own (funcopt allocates it so), which any dense layout of its shape fits."""
    want = torch.empty_like(like).stride()
    if t.stride() != want:
        t.as_strided_(t.size(), want)


@torch.jit.unused
def _eigh_eager(m: Tensor) -> Tensor:
    """The oracle's ``eigh``, with its float64 retry where float32's fails (eager only)."""
    try:
        return torch.linalg.eigh(m + 1e-30 * torch.eye(m.shape[0], device=m.device, dtype=m.dtype))[1]
    except Exception:
        shifted = m.to(torch.float64) + 1e-30 * torch.eye(m.shape[0], device=m.device, dtype=torch.float64)
        return torch.linalg.eigh(shifted)[1].to(m.dtype)


def _eigenbases(ggs: List[Tensor], qs: List[Tensor], order: int) -> None:
    """``Q_i`` := eigenvectors of ``GG_i`` by decreasing eigenvalue (a parameter's first step)."""
    for k in range(order):
        m = ggs[k]
        if m.numel() == 0:
            continue
        if not torch.jit.is_scripting() and not torch.compiler.is_compiling():
            vecs = _eigh_eager(m)
        else:
            vecs = torch.linalg.eigh(m + 1e-30 * torch.eye(m.shape[0], device=m.device, dtype=m.dtype))[1]
        vecs = torch.flip(vecs, [1])
        _layout_like(qs[k], vecs)
        qs[k].copy_(vecs)


def _refreshed(exp_avg_sq: Tensor, ggs: List[Tensor], qs: List[Tensor], order: int, merge: bool,
               max_dim: int, channels_last: bool) -> Tuple[List[Tensor], Tensor]:
    """One power-iteration step and a QR of every factor's basis, and ``exp_avg_sq``
    with each dimension permuted as its basis' columns were sorted: new tensors
    (``Q_i`` where a factor has one, else the old ``Q_i``)."""
    v = _merge(exp_avg_sq, merge, max_dim, channels_last)
    out: List[Tensor] = []
    for k in range(len(ggs)):
        m = ggs[k]
        if k >= order or m.numel() == 0:
            out.append(qs[k])
            continue
        o = qs[k]
        product = m @ o
        est_eig = (o * product).sum(0)
        sort_idx = torch.argsort(est_eig, descending=True)
        v = v.index_select(k, sort_idx)
        power_iter = product.index_select(1, sort_idx)
        q = torch.linalg.qr(power_iter.to(torch.float32))[0]
        out.append(q.to(power_iter.dtype))
    return out, _unmerge(v, list(exp_avg_sq.shape), merge, channels_last)


def _refresh(exp_avg_sq: Tensor, ggs: List[Tensor], qs: List[Tensor], order: int, merge: bool,
             max_dim: int, channels_last: bool) -> None:
    new_qs, v = _refreshed(exp_avg_sq, ggs, qs, order, merge, max_dim, channels_last)
    for k in range(order):
        if ggs[k].numel() > 0:
            _layout_like(qs[k], new_qs[k])
            qs[k].copy_(new_qs[k])
    moved = False
    for k in range(order):
        moved = moved or ggs[k].numel() > 0
    # no factor: v holds exp_avg_sq's values, a view of it in its own layout (nothing to do) or a copy
    # where the merge could not view it (the oracle then keeps that contiguous copy)
    if moved or v.stride() != exp_avg_sq.stride():
        _layout_like(exp_avg_sq, v)
        exp_avg_sq.copy_(v)


def soap(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    ggs: List[Tensor],
    qs: List[Tensor],
    frequencies: List[Tensor],
    shampoo_betas: List[Tensor],
    dims: List[Tensor],
    step: int,
    first: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_precondition_dim: int,
    merge_dims: bool,
    precondition_1d: bool,
    correct_bias: bool,
    normalize_gradient: bool,
    channels_last: bool,
    maximize: bool,
) -> None:
    """Functional SOAP over aligned lists, updated in place, one tensor at a time
    (the oracle's ops in its order: bitwise equal to ``pytorch_optimizer.SOAP``).

    ``step`` is the group's counter after this step's bump (``t``).  ``ggs`` /
    ``qs``: the factor / basis slots, slot-major (``ggs[k * len(params) + j]`` is
    parameter ``j``'s ``GG_k``; an empty tensor where it has none);
    ``frequencies`` / ``shampoo_betas``: each parameter's kept values (0-d);
    ``dims``: each parameter's preconditioned shape as stored (its length is the
    number of ``GG``/``Q`` entries).  ``first``: every parameter is on its first
    gradient (its preconditioner is built first, from this gradient)."""
    n = len(params)
    if n == 0:
        return
    slots = len(ggs) // n
    s = step - 1
    step_size = lr
    if correct_bias and step != 1:
        bias_correction1 = 1.0 - math.pow(beta1, float(s))
        bias_correction2_sq = math.sqrt(1.0 - math.pow(beta2, float(s)))
        step_size = lr * (bias_correction2_sq / bias_correction1)
    for j in range(n):
        p = params[j]
        grad = grads[j]
        shape = list(p.shape)
        order = dims[j].numel()
        gg = [ggs[k * n + j] for k in range(slots)]
        q = [qs[k * n + j] for k in range(slots)]
        admit = _admitted(gg, order, factor_shape(shape, merge_dims, max_precondition_dim, channels_last),
                          max_precondition_dim, len(shape) == 1, precondition_1d)
        weight = 1.0 - float(shampoo_betas[j].item())
        refresh = s > 0 and s % int(frequencies[j].item()) == 0
        if first:
            _layout_like(exp_avgs[j], grad)
            _layout_like(exp_avg_sqs[j], grad)
            _accumulate(_merge(grad, merge_dims, max_precondition_dim, channels_last), gg, order, weight, admit)
            _eigenbases(gg, q, order)
            if refresh:
                _refresh(exp_avg_sqs[j], gg, q, order, merge_dims, max_precondition_dim, channels_last)
        if step == 1:
            continue
        if maximize:
            grad = torch.neg(grad)
        exp_avg = exp_avgs[j]
        exp_avg_sq = exp_avg_sqs[j]
        merged = _merge(grad, merge_dims, max_precondition_dim, channels_last)
        grad_projected = _unmerge(_project(merged, q, order, True), shape, merge_dims, channels_last)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.lerp_(grad_projected.square(), 1.0 - beta2)
        de_nom = exp_avg_sq.sqrt().add_(eps)
        exp_avg_projected = _unmerge(
            _project(_merge(exp_avg, merge_dims, max_precondition_dim, channels_last), q, order, True),
            shape, merge_dims, channels_last)
        norm_grad = _unmerge(
            _project(_merge(exp_avg_projected / de_nom, merge_dims, max_precondition_dim, channels_last),
                     q, order, False), shape, merge_dims, channels_last)
        if normalize_gradient:
            norm_grad.div_(torch.mean(norm_grad.square()).sqrt_().add_(eps))
        p.add_(norm_grad, alpha=-step_size)
        if weight_decay != 0.0:
            p.mul_(1.0 - weight_decay * lr)
        _accumulate(merged, gg, order, weight, admit)
        if refresh:
            _refresh(exp_avg_sq, gg, q, order, merge_dims, max_precondition_dim, channels_last)


@torch.jit.unused
def _soap_compiled(ps: List[Tensor], gr: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                   ggs: List[Tensor], qs: List[Tensor], frequencies: List[Tensor], shampoo_betas: List[Tensor],
                   dims: List[Tensor], counters: Tensor, first: bool, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, max_precondition_dim: int, merge_dims: bool,
                   precondition_1d: bool, correct_bias: bool, normalize_gradient: bool, channels_last: bool,
                   maximize: bool) -> None:
    """:func:`soap` under ``torch.compile``: the group's step counter (``counters[0]``),
    the frequency and ``shampoo_beta`` stay tensors (no host reads, no graph
    break); the group's first step (no update) and the basis refresh are
    selected with ``torch.where`` / ``torch.cond``, so results equal eager's to
    rounding (and the state keeps the parameter's layout)."""
    n = len(ps)
    if n == 0:
        return
    slots = len(ggs) // n
    t = counters[0]
    s = t - 1.0
    skip = t == 1.0
    if correct_bias:
        bc1 = 1.0 - torch.pow(beta1, s)
        bc2 = torch.sqrt(1.0 - torch.pow(beta2, s))
        step_size = torch.where(skip, 0.0, lr * bc2 / torch.where(skip, 1.0, bc1))
    else:
        step_size = torch.where(skip, 0.0, torch.full_like(t, lr))
    for j in range(n):
        p = ps[j]
        grad = gr[j]
        shape = list(p.shape)
        order = dims[j].numel()
        gg = [ggs[k * n + j] for k in range(slots)]
        q = [qs[k * n + j] for k in range(slots)]
        admit = _admitted(gg, order, factor_shape(shape, merge_dims, max_precondition_dim, channels_last),
                          max_precondition_dim, len(shape) == 1, precondition_1d)
        weight = (1.0 - shampoo_betas[j]).to(p.dtype)
        refresh = (s > 0) & (torch.fmod(s, frequencies[j]) == 0)
        skip_p = skip.to(p.device)
        if first:
            _accumulate_t(_merge(grad, merge_dims, max_precondition_dim, channels_last), gg, order, weight,
                          torch.zeros_like(skip_p), admit)
            _eigenbases(gg, q, order)
            _refresh_cond(refresh, exp_avg_sqs[j], gg, q, order, merge_dims, max_precondition_dim, channels_last)
        if maximize:
            grad = torch.neg(grad)
        exp_avg = exp_avgs[j]
        exp_avg_sq = exp_avg_sqs[j]
        merged = _merge(grad, merge_dims, max_precondition_dim, channels_last)
        grad_projected = _unmerge(_project(merged, q, order, True), shape, merge_dims, channels_last)
        exp_avg.copy_(torch.where(skip_p, exp_avg, exp_avg.lerp(grad, 1.0 - beta1)))
        exp_avg_sq.copy_(torch.where(skip_p, exp_avg_sq, exp_avg_sq.lerp(grad_projected.square(), 1.0 - beta2)))
        de_nom = exp_avg_sq.sqrt() + eps
        exp_avg_projected = _unmerge(
            _project(_merge(exp_avg, merge_dims, max_precondition_dim, channels_last), q, order, True),
            shape, merge_dims, channels_last)
        norm_grad = _unmerge(
            _project(_merge(exp_avg_projected / de_nom, merge_dims, max_precondition_dim, channels_last),
                     q, order, False), shape, merge_dims, channels_last)
        if normalize_gradient:
            norm_grad = norm_grad / (torch.mean(norm_grad.square()).sqrt() + eps)
        update = torch.where(skip_p, torch.zeros_like(norm_grad), norm_grad * step_size.to(p.dtype))
        p.sub_(update)
        if weight_decay != 0.0:
            p.mul_(torch.where(skip_p, 1.0, 1.0 - weight_decay * lr).to(p.dtype))
        _accumulate_t(merged, gg, order, weight, skip_p, admit)
        _refresh_cond(refresh & ~skip, exp_avg_sq, gg, q, order, merge_dims, max_precondition_dim, channels_last)


@torch.jit.unused
def _accumulate_t(g: Tensor, ggs: List[Tensor], order: int, weight: Tensor, skip: Tensor, admit: List[bool]) -> None:
    """:func:`_accumulate` with a tensor weight, left as it is where ``skip`` (compiled path)."""
    if g.dim() == 1:
        if admit[0]:
            ggs[0].copy_(torch.where(skip, ggs[0], ggs[0].lerp(g.unsqueeze(1) @ g.unsqueeze(0), weight)))
        return
    for k in range(order):
        if admit[k]:
            dims = [j for j in range(order) if j != k]
            ggs[k].copy_(torch.where(skip, ggs[k], ggs[k].lerp(torch.tensordot(g, g, dims=(dims, dims)), weight)))


@torch.jit.unused
def _refresh_cond(due: Tensor, exp_avg_sq: Tensor, ggs: List[Tensor], qs: List[Tensor], order: int, merge: bool,
                  max_dim: int, channels_last: bool) -> None:
    """:func:`_refresh` where the 0-d boolean ``due`` holds (compiled path: ``torch.cond``)."""
    present = [k for k in range(order) if ggs[k].numel() > 0]
    if len(present) == 0:
        return
    gg_in = [ggs[k] for k in present]
    q_in = [qs[k] for k in present]

    # both branches return fresh contiguous tensors (torch.cond wants the same layouts, no aliasing)
    def refreshed(v: Tensor, gl: List[Tensor], ql: List[Tensor]) -> Tuple[List[Tensor], Tensor]:
        full_g = [torch.empty(0)] * MAX_ORDER
        full_q = [torch.empty(0)] * MAX_ORDER
        for n, k in enumerate(present):
            full_g[k] = gl[n]
            full_q[k] = ql[n]
        new_q, new_v = _refreshed(v, full_g, full_q, order, merge, max_dim, channels_last)
        return [new_q[k].clone(memory_format=torch.contiguous_format) for k in present], \
            new_v.clone(memory_format=torch.contiguous_format)

    def kept(v: Tensor, gl: List[Tensor], ql: List[Tensor]) -> Tuple[List[Tensor], Tensor]:
        return ([x.clone(memory_format=torch.contiguous_format) for x in ql],
                v.clone(memory_format=torch.contiguous_format))

    new_q, new_v = torch.cond(due, refreshed, kept, (exp_avg_sq, gg_in, q_in))
    for n, k in enumerate(present):
        qs[k].copy_(new_q[n])
    exp_avg_sq.copy_(new_v)


class SOAPKernel:
    """SOAP for the shared core (slots: exp_avg, exp_avg_sq, GG0.., Q0..,
    precondition_frequency, shampoo_beta; one group value: step)."""

    def __init__(self) -> None:
        self.name = "SOAP"
        # the slot layout (TorchScript reads no module-level ints): MAX_ORDER, _GG, _Q, _FREQ, _BETA
        self.order = 8
        self.gg = 2
        self.q = 10
        self.freq = 18
        self.beta = 19
        self.dims = 20

    def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
        sizes = factor_sizes(list(p.shape), h["merge_dims"] != 0.0, int(h["max_precondition_dim"]),
                             h["precondition_1d"] != 0.0, h["data_format"] != 0.0)
        gg: List[Tensor] = []
        q: List[Tensor] = []
        for k in range(self.order):
            n = sizes[k] if k < len(sizes) else -1
            if n >= 0:
                gg.append(torch.empty([n, n], dtype=p.dtype, device=p.device).zero_())
            else:
                gg.append(torch.empty(0))
            if n > 0:
                # column-major, as eigh and QR return their bases (the oracle keeps those tensors; the
                # projections' matrix products round by layout)
                q.append(torch.empty([n, n], dtype=p.dtype, device=p.device).zero_().t())
            else:
                q.append(torch.empty(0))
        out: List[Tensor] = [zeros_like(p), zeros_like(p)]
        out.extend(gg)
        out.extend(q)
        out.append(torch.empty([], dtype=torch.float64).fill_(h["precondition_frequency"]))
        out.append(torch.empty([], dtype=torch.float64).fill_(h.get("shampoo_beta", h["betas1"])))
        dims = factor_shape(list(p.shape), h["merge_dims"] != 0.0, int(h["max_precondition_dim"]),
                            h["data_format"] != 0.0)
        out.append(torch.tensor(dims, dtype=torch.float64).reshape([len(dims)]))
        return out

    def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
              odd: bool) -> None:
        merge = h["merge_dims"] != 0.0
        max_dim = int(h["max_precondition_dim"])
        channels_last = h["data_format"] != 0.0
        for i in idx:
            if params[i].is_complex():
                raise RuntimeError("SOAP does not support complex parameter.")
        for i in idx:
            shape = list(params[i].shape)
            order = len(factor_shape(shape, merge, max_dim, channels_last))
            if order > self.order:
                raise ValueError(
                    "funcopt: parameter " + str(i) + " of shape " + str(shape) + " has " + str(order)
                    + " dimensions to precondition; SOAP keeps at most " + str(self.order)
                    + " (merge_dims=True merges small ones)")
            if merge:
                n = _numel(shape)
                merged = merge_small_dims(_channels_first(shape) if channels_last and len(shape) == 4 else shape,
                                          max_dim)
                if _numel(merged) != n:
                    raise ValueError(
                        "funcopt: parameter " + str(i) + " of shape " + str(shape) + " cannot be merged with "
                        "merge_dims=True and max_precondition_dim=" + str(max_dim) + ": all its " + str(n)
                        + " elements fit in one merged dimension, which pytorch_optimizer's merge_small_dims "
                        "makes [1] (the oracle fails: shape '[1]' is invalid for input of size " + str(n)
                        + "); use merge_dims=False or a max_precondition_dim below " + str(n))

    def _check_state(self, params: List[Tensor], state: List[List[Tensor]], h: Dict[str, float]) -> None:
        """The stored preconditioners can be stepped under the group's options
        (:func:`state_problem`; the Python class checks every parameter before the
        step, this is the core's own guard, for a core stepped without it)."""
        merge = h["merge_dims"] != 0.0
        max_dim = int(h["max_precondition_dim"])
        p1d = h["precondition_1d"] != 0.0
        channels_last = h["data_format"] != 0.0
        for j in range(len(params)):
            order = state[self.dims][j].numel()
            ggs = [state[self.gg + k][j] for k in range(self.order)]
            why = state_problem(list(params[j].shape), order, _stored_sizes(ggs, order), merge, max_dim, p1d,
                                channels_last)
            if why != "":
                raise ValueError("funcopt: SOAP cannot step a parameter of shape " + str(list(params[j].shape))
                                 + ": " + why)

    def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
              h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
              found_inf: Optional[Tensor]) -> None:
        if not first:
            self._check_state(params, state, h)
        counters = state[len(state) - 1][0]
        ggs: List[Tensor] = []
        qs: List[Tensor] = []
        for k in range(self.order):
            ggs.extend(state[self.gg + k])
            qs.extend(state[self.q + k])
        merge = h["merge_dims"] != 0.0
        max_dim = int(h["max_precondition_dim"])
        if not torch.jit.is_scripting():
            if torch.compiler.is_compiling():
                _soap_compiled(params, grads, state[0], state[1], ggs, qs, state[self.freq], state[self.beta],
                               state[self.dims], counters, first, h["lr"], h["betas0"], h["betas1"], h["eps"],
                               h["weight_decay"], max_dim, merge, h["precondition_1d"] != 0.0,
                               h["correct_bias"] != 0.0, h["normalize_gradient"] != 0.0, h["data_format"] != 0.0,
                               h["maximize"] != 0.0)
                return
        soap(params, grads, state[0], state[1], ggs, qs, state[self.freq], state[self.beta], state[self.dims],
             int(counters[0].item()), first, h["lr"], h["betas0"], h["betas1"], h["eps"], h["weight_decay"],
             max_dim, merge, h["precondition_1d"] != 0.0, h["correct_bias"] != 0.0, h["normalize_gradient"] != 0.0,
             h["data_format"] != 0.0, h["maximize"] != 0.0)

    def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
               h: Dict[str, float], first: bool) -> List[List[Tensor]]:
        # the oracle's only formula is per tensor: the same as dense (not reached by the core:
        # sparse gradients are refused and SOAP has no differentiable=True)
        self.dense(params, grads, state, h, False, first, None, None)
        return state






_k = SOAPKernel()
assert (_k.order, _k.gg, _k.q, _k.freq, _k.beta, _k.dims) == _LAYOUT
del _k


def _copy(v: Tensor, p: Tensor) -> Tensor:
    """Loaded state ``v`` in ``p``'s dtype and device, in ``v``'s layout where it is dense
    (as torch's ``load_state_dict`` keeps it: the projections round by layout), in a
    storage of its own."""
    return torch.empty_like(v, dtype=p.dtype, device=p.device).copy_(v.detach())


def _is_absent(v: Any) -> bool:
    """An absent factor as a state dict holds it: ``[]`` (the oracle) or an empty tensor."""
    if isinstance(v, (list, tuple)):
        return len(v) == 0
    return isinstance(v, Tensor) and v.numel() == 0 and v.dim() != 2


def _check_ranges(group: Mapping[str, Any]) -> None:
    """The oracle's constructor checks (``pytorch_optimizer.SOAP``), its words, as
    ``ValueError`` (its ``NegativeLRError`` is not one), with the key and value."""
    def bad(msg: str, key: str) -> None:
        raise ValueError(f"{msg} ({key}={group[key]!r})")

    lr = group.get("lr")
    if lr is not None and lr < 0.0:  # pytorch_optimizer's NegativeLRError too, where it is imported
        from .adopt import oracle_error

        raise oracle_error("NegativeLRError", f"learning rate must be positive. ({lr} > 0) (lr={lr!r})")
    betas = group.get("betas")
    if betas is not None:
        for j, name in enumerate(("beta1", "beta2")):
            if not 0.0 <= betas[j] < 1.0:
                bad(f"{name} must be in the range [0.0, 1.0)", "betas")
    sb = group.get("shampoo_beta")
    if sb is not None and (isinstance(sb, bool) or not isinstance(sb, (int, float, Tensor))
                           or (isinstance(sb, Tensor) and sb.numel() != 1)):
        raise TypeError(f"SOAP: shampoo_beta must be None or a number, got shampoo_beta={sb!r}")
    for key in ("shampoo_beta", "weight_decay", "eps"):
        if group.get(key) is not None and group[key] < 0.0:
            bad(f"{key} must be non-negative", key)
    for key in ("precondition_frequency", "max_precondition_dim"):
        if group.get(key) is not None and group[key] <= 0:
            bad(f"{key} must be positive", key)


class SOAP(Optimizer):
    r"""SOAP (Vyas et al. 2024), as ``pytorch_optimizer.SOAP``, with a functional,
    scriptable step: Adam in the eigenbasis of Shampoo's preconditioner.

    Args:
      params: iterable of tensors, of ``(name, tensor)`` pairs, or of param-group dicts.
      lr: learning rate (default ``3e-3``).
      betas: ``(beta1, beta2)`` of Adam's moments (default ``(0.95, 0.95)``).
      shampoo_beta: decay of the preconditioner's factors ``GG`` (``None``: ``beta2``; default ``None``).
      weight_decay: decoupled decay after the update, ``p *= 1 - lr * weight_decay`` (default ``1e-2``).
      precondition_frequency: steps between refreshes of the eigenbases (default ``10``).
      max_precondition_dim: larger dimensions get no factor (identity) (default ``10000``).
      merge_dims: merge neighbouring small dimensions before preconditioning (default ``False``).
      precondition_1d: precondition vectors too (default ``False``).
      correct_bias: Adam's bias correction of the step size (default ``True``).
      normalize_gradient: divide the update by its RMS (default ``False``).
      data_format: ``"channels_first"`` or ``"channels_last"`` (NHWC 4-D parameters, for
        ``merge_dims``) (default ``"channels_first"``).
      eps: added to the denominator (default ``1e-8``).
      maximize: ascend instead of descend (default ``False``).
      impl: ``"auto"`` or ``"foreach"`` (both: the per-tensor formula; the oracle has no other).

    The group's first step only builds the preconditioner (the oracle's rule):
    parameters move from the second step on.

    Example::

        >>> import torch, funcopt
        >>> w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
        >>> opt = funcopt.SOAP([w], lr=0.1, weight_decay=0.0)
        >>> for _ in range(3):
        ...     opt.step([torch.tensor([[1.0, 0.0], [0.0, 1.0]])])
        >>> w
        tensor([[0.8000, 2.0000],
                [3.0000, 3.8000]], requires_grad=True)
        >>> opt.param_groups[0]["step"], [tuple(q.shape) for q in opt.state[w]["Q"]]
        (3, [(2, 2), (2, 2)])
    """

    torch_class = "pytorch_optimizer:SOAP"
    kernel_class = SOAPKernel
    group_rule_class = StepCounter  # group['step'] += 1 each step
    sparse_msg = "SOAP does not support sparse gradient."
    slots = ((("exp_avg", None), ("exp_avg_sq", None))
             + tuple((f"GG{k}", None) for k in range(MAX_ORDER))
             + tuple((f"Q{k}", None) for k in range(MAX_ORDER))
             + (("precondition_frequency", None), ("shampoo_beta", None), ("dims", None)))
    group_state = (("step", 0),)
    group_state_lazy = ("step",)  # pytorch_optimizer adds group['step'] at the first step
    complex_differs_from_oracle = True  # refused (the oracle raises its NoComplexParameterError)
    hyper_codes = {"data_format": DATA_FORMAT_CODES}
    whole_params = True
    split_first = True  # a parameter's first gradient builds its preconditioner first
    check_ranges = staticmethod(_check_ranges)

    def __init__(self, params: Any, lr: float = 3e-3, betas: Tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: Optional[float] = None, weight_decay: float = 1e-2, precondition_frequency: int = 10,
                 max_precondition_dim: int = 10000, merge_dims: bool = False, precondition_1d: bool = False,
                 correct_bias: bool = True, normalize_gradient: bool = False, data_format: str = "channels_first",
                 eps: float = 1e-8, maximize: bool = False, *, impl: str = "auto") -> None:
        super().__init__(params, dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, weight_decay=weight_decay,
                                      precondition_frequency=precondition_frequency,
                                      max_precondition_dim=max_precondition_dim, merge_dims=merge_dims,
                                      precondition_1d=precondition_1d, correct_bias=correct_bias,
                                      normalize_gradient=normalize_gradient, data_format=data_format, eps=eps,
                                      maximize=maximize), impl)

    # ------------------------------------------------------------ state shapes
    @classmethod
    def _options(cls, group: Mapping[str, Any]) -> Tuple[bool, int, bool, bool]:
        """``(merge_dims, max_precondition_dim, precondition_1d, channels_last)`` of a
        param group (its flattened core form or its dict; missing keys: the defaults)."""
        def get(key: str) -> Any:
            return group[key] if key in group else _DEFAULTS[key]

        channels_last = get("data_format")
        if not isinstance(channels_last, float):
            channels_last = DATA_FORMAT_CODES.get(channels_last, 0.0)
        return (bool(get("merge_dims")), int(get("max_precondition_dim")), bool(get("precondition_1d")),
                bool(channels_last))

    @classmethod
    def slot_shape(cls, name: str, p: Tensor, group: Optional[Mapping[str, Any]] = None) -> Optional[Tuple[int, ...]]:
        """Shape of state slot ``name`` for ``p`` created in a group with ``group``'s
        options (default: the constructor's defaults): ``exp_avg``/``exp_avg_sq``
        like ``p``; ``GG<k>`` and ``Q<k>`` ``n x n`` for a preconditioned dimension
        of size ``n`` that has a factor (no ``Q<k>`` where ``n`` is 0); the kept
        ``precondition_frequency``/``shampoo_beta`` 0-d; ``dims`` one entry per
        preconditioned dimension; ``None`` where absent."""
        merge, max_dim, p1d, channels_last = cls._options(group or {})
        if name in ("exp_avg", "exp_avg_sq"):
            return tuple(p.shape)
        if name in ("precondition_frequency", "shampoo_beta"):
            return ()
        if name == "dims":
            return (len(factor_shape(list(p.shape), merge, max_dim, channels_last)),)
        sizes = factor_sizes(list(p.shape), merge, max_dim, p1d, channels_last)
        k = int(name[2:] if name.startswith("GG") else name[1:])
        n = sizes[k] if k < len(sizes) else -1
        if n < 0 or (name.startswith("Q") and n == 0):
            return None
        return (n, n)

    def _run(self, grads: List[Optional[Tensor]], grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
        """The base class's step, after checking -- before anything changes -- that
        every stored preconditioner can be stepped under its group's options (they
        may have changed since it was made: :func:`state_problem`).  Checked again
        only when the options or the state changed."""
        if not torch.compiler.is_compiling():
            key = (self._slots.epoch, tuple(self._options(h) for h in self._hyper_cache))
            if self.__dict__.get("_soap_checked") != key:
                self._check_preconditioners()
                self.__dict__["_soap_checked"] = key
        super()._run(grads, grad_scale, found_inf)

    def _check_preconditioners(self) -> None:
        slots = self._slots
        params = self._flat_params()
        for i, p in enumerate(slots.params if self._dt is None else params):
            if not slots.state_present(i):
                continue
            order = slots.get_state(_DIMS, i).numel()
            sizes = [t.size(0) if t.dim() == 2 else -1 for t in (slots.get_state(_GG + k, i) for k in range(order))]
            why = state_problem(list(p.shape), order, sizes, *self._options(self._hyper_cache[self._group_of[i]]))
            if why:
                raise ValueError(self._explain(f"funcopt: SOAP cannot step parameter {i} (shape {tuple(p.shape)}): "
                                               f"{why}; keep these options, or restart its state "
                                               f"(del opt.state[p])"))

    # ------------------------------------------------ the oracle's state format
    def _state_entry(self, i: int, p: Optional[Tensor] = None) -> Dict[str, Any]:
        """Parameter ``i``'s state as the oracle keeps it (``GG``/``Q`` lists of one
        entry per preconditioned dimension, ``[]`` where it has no factor; Python
        numbers)."""
        slots = self._slots
        if not slots.state_present(i):
            return {}
        order = slots.get_state(_DIMS, i).numel()
        gg: List[Any] = []
        q: List[Any] = []
        for k in range(order):
            t = slots.get_state(_GG + k, i)
            gg.append(t if t.dim() == 2 else [])
            t = slots.get_state(_Q + k, i)
            q.append(t if t.numel() > 0 else [])
        entry: Dict[str, Any] = {"exp_avg": slots.get_state(0, i), "exp_avg_sq": slots.get_state(1, i), "GG": gg,
                                 "Q": q, "precondition_frequency": int(slots.get_state(_FREQ, i).item()),
                                 "shampoo_beta": float(slots.get_state(_BETA, i).item())}
        if self._dt is not None:
            for name in ("exp_avg", "exp_avg_sq"):
                entry[name] = self._dt.wrap(i, name, entry[name], self._dt_cache)
        return entry

    def _convert_entry(self, sid: Any, p: Tensor, entry: Dict[str, Any], group: Dict[str, Any]) -> List[Tensor]:
        """An entry in the oracle's format -> slot tensors, checked (shapes, dtypes,
        and that the group's options can step it: :func:`state_problem`); a tensor
        that already is this parameter's slot is kept as it is, others are copied
        in their own layout."""
        from .. import _dtensor

        if self._dt is not None and _dtensor.is_dtensor(p):
            p, entry = self._dt.unwrap_entry(p, entry)
        owner = f"{type(self).__name__}.load_state_dict"
        keys = {"exp_avg", "exp_avg_sq", "GG", "Q", "precondition_frequency", "shampoo_beta"}
        if not isinstance(entry, Mapping) or set(entry) != keys:
            got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(f"{owner}: state of parameter {sid!r} has keys {got}, expected {sorted(keys)}")
        current: List[Tensor] = []
        for i, q in enumerate(self._slots.params if self._dt is None else self._dt.params):
            if q is p and self._slots.state_present(i):
                current = [self._slots.get_state(k, i) for k in range(_NUM_SLOTS)]
        vals: List[Tensor] = []
        for n, name in enumerate(("exp_avg", "exp_avg_sq")):
            v = entry[name]
            if not isinstance(v, Tensor):
                raise ValueError(f"{owner}: '{name}' of parameter {sid!r} is not a tensor")
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"{owner}: '{name}' of parameter {sid!r} has shape {tuple(v.shape)}, "
                                 f"parameter has {tuple(p.shape)}")
            if not v.is_floating_point():
                raise ValueError(f"{owner}: '{name}' of parameter {sid!r} has dtype {v.dtype}, "
                                 f"parameter has {p.dtype}")
            vals.append(v if current and v is current[n] else _copy(v, p))
        gg, q = entry["GG"], entry["Q"]
        for name, seq in (("GG", gg), ("Q", q)):
            if not isinstance(seq, (list, tuple)) or len(seq) > MAX_ORDER:
                raise ValueError(f"{owner}: '{name}' of parameter {sid!r} must be a list of at most {MAX_ORDER} "
                                 f"entries (one per preconditioned dimension), got "
                                 f"{len(seq) if isinstance(seq, (list, tuple)) else type(seq).__name__}")
        order = len(gg)
        if len(q) != order:
            raise ValueError(f"{owner}: 'GG' and 'Q' of parameter {sid!r} have {order} and {len(q)} entries")
        sizes = []
        for k in range(order):
            if _is_absent(gg[k]):
                sizes.append(-1)
                continue
            v = gg[k]
            if not isinstance(v, Tensor) or v.dim() != 2 or v.shape[0] != v.shape[1]:
                what = tuple(v.shape) if isinstance(v, Tensor) else v
                raise ValueError(f"{owner}: 'GG'[{k}] of parameter {sid!r} must be [] or a square matrix, got {what!r}")
            sizes.append(v.shape[0])
        why = state_problem(list(p.shape), order, sizes, *self._options(group))
        if why:
            raise ValueError(f"{owner}: state of parameter {sid!r} (shape {tuple(p.shape)}) cannot be stepped "
                             f"with its group's options: {why}")
        for name, col, seq in (("GG", _GG, gg), ("Q", _Q, q)):
            for k in range(MAX_ORDER):
                n = sizes[k] if k < order else -1
                if name == "Q" and n == 0:
                    n = -1
                if n < 0:
                    if k < order and not _is_absent(seq[k]):
                        raise ValueError(f"{owner}: '{name}'[{k}] of parameter {sid!r} must be [] (this dimension "
                                         f"has no factor)")
                    vals.append(torch.empty(0))
                    continue
                v = seq[k]
                if not isinstance(v, Tensor) or tuple(v.shape) != (n, n):
                    what = tuple(v.shape) if isinstance(v, Tensor) else v
                    raise ValueError(f"{owner}: '{name}'[{k}] of parameter {sid!r} must be a {n} x {n} tensor, "
                                     f"got {what!r}")
                if not v.is_floating_point():
                    raise ValueError(f"{owner}: '{name}'[{k}] of parameter {sid!r} has dtype {v.dtype}, "
                                     f"parameter has {p.dtype}")
                vals.append(v if current and v is current[col + k] else _copy(v, p))
        for name in ("precondition_frequency", "shampoo_beta"):
            v = entry[name]
            if isinstance(v, Tensor) and v.numel() == 1 and not v.is_complex():
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"{owner}: '{name}' of parameter {sid!r} must be a number, got {v!r}")
            if name == "precondition_frequency" and (v != int(v) or v <= 0):
                raise ValueError(f"{owner}: 'precondition_frequency' of parameter {sid!r} must be a positive "
                                 f"integer, got {v!r}")
            vals.append(torch.tensor(float(v), dtype=torch.float64))
        merge, max_dim, _, channels_last = self._options(group)
        dims = factor_shape(list(p.shape), merge, max_dim, channels_last)  # == order entries (state_problem)
        vals.append(torch.tensor(dims, dtype=torch.float64).reshape(len(dims)))
        return vals

    def state_dict(self) -> Dict[str, Any]:
        """The oracle's format: ``data_format`` and ``maximize`` only in a group that
        differs from this optimizer's defaults, ``step`` once a step ran
        (:func:`funcopt.optimizers.adopt.strip_instance_keys`)."""
        return strip_instance_keys(self, super().state_dict(), INSTANCE_KEYS)

    def stage_state(self, state_dict: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], Dict[Any, Any]]:
        """As :meth:`funcopt.Optimizer.stage_state`; a group without ``data_format`` /
        ``maximize`` (the oracle's: attributes of its instance) takes this
        optimizer's constructor values."""
        return super().stage_state(fill_instance_keys(self, state_dict, INSTANCE_KEYS))


# what pytorch_optimizer.SOAP keeps on the instance, not in its param groups
INSTANCE_KEYS = ("data_format", "maximize")
# the oracle's verdict on a tensor lr cannot be followed: it multiplies the group's lr tensor in
# place (step_size *= ...), so the lr compounds from step to step; funcopt uses its value
NO_ORACLE_VERDICT = ("lr",)
_DEFAULTS = dict(merge_dims=False, max_precondition_dim=10000, precondition_1d=False, data_format="channels_first")

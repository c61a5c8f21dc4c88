"""Small scriptable helpers the algorithm files share."""
from typing import List, Optional, Union

import torch
from torch import Tensor

# TorchScript's ``Scalar[]`` (``List[number]``): a ``List[float]`` does not match
# the per-tensor-scalar overloads of the ``_foreach_*`` ops, this does.
Scalars = List[Union[int, float, complex]]


def scalars(xs: List[float]) -> List[Union[int, float, complex]]:
    out: List[Union[int, float, complex]] = []
    for x in xs:
        out.append(x)
    return out


def step_values(steps: List[Tensor]) -> List[float]:
    """Host values of per-parameter step counters (CPU tensors on the foreach path)."""
    return [float(s.item()) for s in steps]


def bump(steps: List[Tensor], base: Optional[Tensor] = None) -> None:
    """``steps += 1``.  ``base``: a tensor whose elements are exactly ``steps``
    (``Slots.step_base``): one op.  Otherwise, for CPU counters the one-tensor
    overload is ~5x faster than the Scalar one (which wraps the scalar once per
    tensor), as torch.optim also does; same float32 result."""
    if base is not None:
        base.add_(1.0)
    elif len(steps) > 0 and steps[0].is_cpu:
        torch._foreach_add_(steps, torch.ones(()), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1.0)


def skip_step(found_inf: Optional[Tensor]) -> bool:
    """foreach path only: the fused kernels check ``found_inf`` on device."""
    if found_inf is None:
        return False
    return bool(found_inf.item() != 0)


def unscale(grads: List[Tensor], grad_scale: Optional[Tensor]) -> List[Tensor]:
    if grad_scale is None:
        return grads
    return torch._foreach_div(grads, grad_scale)


# State allocation ends with an in-place fill on purpose: TorchScript's
# common-subexpression elimination merges identical pure allocations whose
# later writes it cannot see (they happen through lists), which would make two
# state tensors one.  A tensor written by ``fill_``/``zero_`` is never merged.


def step_tensor(p: Tensor, fused: bool) -> Tensor:
    """A fresh step counter, where torch.optim keeps it: on the parameter's
    device for the fused kernels, on the CPU otherwise."""
    if fused:
        return torch.empty((), dtype=torch.float32, device=p.device).zero_()
    return torch.empty((), dtype=torch.float32).zero_()


def zeros_like(p: Tensor) -> Tensor:
    return torch.empty_like(p, memory_format=torch.preserve_format).zero_()


def full_like(p: Tensor, value: float) -> Tensor:
    return torch.empty_like(p, memory_format=torch.preserve_format).fill_(value)

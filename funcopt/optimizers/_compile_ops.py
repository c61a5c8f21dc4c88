"""torch's fused optimizer kernels as opaque ops for ``torch.compile``.

Under ``torch.compile`` the in-place ATen fused ops (``torch._fused_adam_``,
``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``) cannot be
functionalized on torch 2.13 (their out-of-place twins can, at the price of a
copy of every parameter and state tensor: 2-5x the eager step), and letting
inductor fuse the foreach formula instead gives a step slower than the eager
fused kernel on CPU.  These wrappers are ``torch.library.custom_op`` s whose
body calls the fused kernel and whose fake implementation changes nothing:
the compiled graph holds one call that mutates its inputs in place, so a
compiled step costs what the eager fused step costs.  They take exactly the
fused kernels' arguments (``grad_scale`` / ``found_inf`` included: no host
sync under compile either).

Registering a custom op is not scripting and costs well under a millisecond.
The calls sit under ``if not torch.jit.is_scripting():``, which TorchScript
does not compile: a scripted (and saved) step holds ATen ops only and loads
where funcopt is absent.
"""
from typing import List, Optional

import torch
from torch import Tensor

_NS = "funcopt_aten"


@torch.library.custom_op(f"{_NS}::fused_adam_", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))
def fused_adam_(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                max_exp_avg_sqs: List[Tensor], steps: List[Tensor], lr: float, beta1: float, beta2: float,
                weight_decay: float, eps: float, amsgrad: bool, maximize: bool, decoupled: bool,
                grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    f = torch._fused_adamw_ if decoupled else torch._fused_adam_
    f(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
      weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
      found_inf=found_inf)


@fused_adam_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,  # noqa: ANN001
      amsgrad, maximize, decoupled, grad_scale, found_inf) -> None:
    return None


@torch.library.custom_op(f"{_NS}::fused_sgd_", mutates_args=("params", "momentum_buffers"))
def fused_sgd_(params: List[Tensor], grads: List[Tensor], momentum_buffers: List[Tensor], weight_decay: float,
               momentum: float, lr: float, dampening: float, nesterov: bool, maximize: bool, is_first_step: bool,
               grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    torch._fused_sgd_(params, grads, momentum_buffers, weight_decay=weight_decay, momentum=momentum, lr=lr,
                      dampening=dampening, nesterov=nesterov, maximize=maximize, is_first_step=is_first_step,
                      grad_scale=grad_scale, found_inf=found_inf)


@fused_sgd_.register_fake
def _(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov, maximize,  # noqa: ANN001
      is_first_step, grad_scale, found_inf) -> None:
    return None


@torch.library.custom_op(f"{_NS}::fused_adagrad_", mutates_args=("params", "state_sums"))
def fused_adagrad_(params: List[Tensor], grads: List[Tensor], state_sums: List[Tensor], steps: List[Tensor],
                   lr: float, lr_decay: float, weight_decay: float, eps: float, maximize: bool,
                   grad_scale: Optional[Tensor], found_inf: Optional[Tensor]) -> None:
    torch._fused_adagrad_(params, grads, state_sums, steps, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                          eps=eps, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)


@fused_adagrad_.register_fake
def _(params, grads, state_sums, steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,  # noqa: ANN001
      found_inf) -> None:
    return None

r"""AdamW: Adam with decoupled weight decay (``p *= 1 - lr * weight_decay``).

The update rule and kernel are Adam's (:func:`funcopt.optimizers.adam.adam`
with ``decoupled=True``, ``torch._fused_adamw_`` when fused); this file only
binds torch.optim.AdamW's defaults and state format.
"""
from typing import Any, Optional, Tuple

import torch

from .adam import Adam


class AdamW(Adam):
    r"""AdamW, as ``torch.optim.AdamW`` (default ``weight_decay=1e-2``).

    Args: as :class:`funcopt.Adam` without ``decoupled_weight_decay`` (always on).

    Example::

        >>> import torch, funcopt
        >>> w = torch.ones(2, requires_grad=True)
        >>> opt = funcopt.AdamW([w], lr=0.1, weight_decay=0.1)
        >>> opt.step([torch.zeros(2)])
        >>> w
        tensor([0.9900, 0.9900], requires_grad=True)
    """

    torch_class = torch.optim.AdamW

    def __init__(self, params: Any, lr: Any = 1e-3, betas: Tuple[Any, Any] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, impl: str = "auto") -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, impl=impl)

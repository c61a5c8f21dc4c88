"""funcopt: functional, TorchScript-compatible optimizers for PyTorch.

``step(grads)`` takes an explicit gradient list, state lives in plain tensors,
and the step compiles with ``torch.jit.script`` (``funcopt.script``).  Every
algorithm matches the ``torch.optim`` class of the same name, bit for bit
where the same kernel runs, with the same ``state_dict`` format.
"""
from . import registry
from .backward import StepInBackward, step_in_backward
from .base import Optimizer
from .clip import clip_grad_norm_
from .registry import REGISTRY
from .script import script

# every registered algorithm, by its torch.optim name (funcopt.SGD, funcopt.Adam, ...)
globals().update({name: spec.cls for name, spec in REGISTRY.items()})

__all__ = ["Optimizer", "REGISTRY", "StepInBackward", "clip_grad_norm_", "registry", "script", "step_in_backward"]
__all__.extend(REGISTRY)  # the algorithms
__version__ = "0.1.0"

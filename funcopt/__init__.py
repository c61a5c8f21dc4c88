"""funcopt: functional, TorchScript-compatible optimizers for PyTorch."""
from .base import Optimizer
from .optimizers.adam import Adam
from .script import script

__version__ = "0.1.0"

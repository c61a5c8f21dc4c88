"""Distributed layers over the funcopt core (torch.distributed / RPC only).

Nothing here reimplements an update rule: every layer builds a funcopt
optimizer over its shard and calls ``step(grads)``.
"""
from ._comm import DistributedError
from ._local import EagerFallbackWarning
from .checkpointer import Checkpointer, CheckpointWarning
from .bucketer import ReduceScatterBucketer
from .hooks import DDPStepHook, ddp_step_hook
from .zero import Layout, Segment, make_layout
from .rpc import DistributedOptimizer
from .zero import ZeroRedundancyOptimizer
from .zero.root3 import Zero3Sequential
from .zero.stage3 import Zero3Layer
from .zero.overlap import hook_with_zero_step, hook_with_zero_step_interleaved
from .zero.wrap import zero3

__all__ = ["CheckpointWarning", "Checkpointer", "DDPStepHook", "DistributedError", "DistributedOptimizer", "EagerFallbackWarning", "Layout", "ReduceScatterBucketer", "Segment", "Zero3Layer", "Zero3Sequential", "ZeroRedundancyOptimizer", "ddp_step_hook", "hook_with_zero_step", "hook_with_zero_step_interleaved", "make_layout", "zero3"]

"""Distributed layers over the funcopt core (torch.distributed / RPC only).

Nothing here reimplements an update rule: every layer builds a funcopt
optimizer over its shard and calls ``step(grads)``.
"""
from ._comm import DistributedError
from .bucketer import ReduceScatterBucketer
from .zero import Layout, Segment, make_layout
from .rpc import DistributedOptimizer
from .zero import ZeroRedundancyOptimizer

__all__ = ["DistributedError", "DistributedOptimizer", "Layout", "ReduceScatterBucketer", "Segment", "ZeroRedundancyOptimizer", "make_layout"]

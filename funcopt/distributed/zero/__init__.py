"""ZeRO: optimizer state, gradients and parameters sharded over the ranks of a process group.

One module per job, shared by every stage:

* :mod:`~funcopt.distributed.zero.layout`: who owns which elements (the partition);
* ``_grads``: gradient shards (ZeRO-2's reduce-scatter during backward);
* ``_sync``: parameter homes and the parameter sync after a step;
* ``_pieces``: sharded optimizer state as pieces (consolidation, resharding);
* :mod:`~funcopt.distributed.zero.checkpoint`: sharded checkpoints through
  ``torch.distributed.checkpoint``, committed atomically;
* :mod:`~funcopt.distributed.zero.optimizer`: :class:`ZeroRedundancyOptimizer`
  (ZeRO-1/2).
"""
from .layout import Layout, Segment, make_layout
from .optimizer import ZeroRedundancyOptimizer

__all__ = ["Layout", "Segment", "ZeroRedundancyOptimizer", "make_layout"]

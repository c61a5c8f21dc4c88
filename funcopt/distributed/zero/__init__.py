"""ZeRO: optimizer state, gradients and parameters sharded over the ranks of a process group.

One module per job, shared by every stage; no module reads another's private
attributes:

* :mod:`~funcopt.distributed.zero.layout`: who owns which elements (the partition);
* ``_grads``: gradient shards (ZeRO-2's reduce-scatter during backward);
* ``_sync``: parameter homes and the parameter sync after a step;
* ``state`` and ``_pieces``: sharded optimizer state (the local optimizer over
  a rank's segments; pieces for consolidation and resharding);
* :mod:`~funcopt.distributed.zero.checkpoint`: sharded checkpoints of every
  stage through ``torch.distributed.checkpoint``, committed atomically
  (``_ckpt12``: what ZeRO-1/2 saves, ``_ckpt3``: what ZeRO-3 saves);
* :mod:`~funcopt.distributed.zero.optimizer`: :class:`ZeroRedundancyOptimizer`
  (ZeRO-1/2);
* ``stage3``, ``root3``, ``wrap``: ZeRO-3 layers (``Zero3Layer``,
  ``Zero3Sequential``, ``zero3``).
"""
from .layout import Layout, Segment, make_layout
from .optimizer import ZeroRedundancyOptimizer

__all__ = ["Layout", "Segment", "ZeroRedundancyOptimizer", "make_layout"]

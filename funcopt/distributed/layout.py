"""Old import path of :mod:`funcopt.distributed.zero.layout` (kept for existing imports)."""
from .zero.layout import PARTITIONS, Layout, Segment, Space, chunks, make_layout

__all__ = ["PARTITIONS", "Layout", "Segment", "Space", "chunks", "make_layout"]

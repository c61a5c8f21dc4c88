"""Old import path of :mod:`funcopt.distributed.zero.checkpoint` (kept for existing imports)."""
from .zero.checkpoint import (COMMIT, FORMAT, SAVE_PREFIX, TMP_PREFIX, committed_dir, load_sharded,
                              read_record, save_sharded, to_torch_state_dict)

__all__ = ["COMMIT", "FORMAT", "SAVE_PREFIX", "TMP_PREFIX", "committed_dir", "load_sharded", "read_record",
           "save_sharded", "to_torch_state_dict"]

"""Small file and failure helpers shared by the checkpoint writers (local, no collectives)."""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict

from torch.distributed.checkpoint.api import CheckpointException

# DCP's CheckpointException (every rank's failures, raised on every rank) is a BaseException
FAILURES = (Exception, CheckpointException)


def failure_text(e: BaseException) -> str:
    """One line naming ``e`` (for DCP's CheckpointException: every failing rank's exception)."""
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: WrappedException}
    if isinstance(failures, dict) and failures:
        excs = {r: (w[0] if isinstance(w, tuple) else getattr(w, "exc", w)) for r, w in failures.items()}
        inner = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(excs.items()))
        return f"torch.distributed.checkpoint failed ({inner})"[:2000]
    return f"{type(e).__name__}: {e}"[:2000]


def hash_file(file: str, sync: bool = False) -> Dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of ``file`` (``sync``: fsync it too)."""
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            size += len(block)
        if sync:
            os.fsync(fh.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

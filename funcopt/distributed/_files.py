"""Small file and failure helpers shared by the checkpoint writers (local, no collectives)."""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Callable, Dict, List, Pattern, Sequence, Tuple


def failures() -> Tuple[type, ...]:
    """What a save or load may fail with (``except failures() as e``): ``Exception`` and DCP's
    ``CheckpointException`` (every rank's failures, raised on every rank: a ``BaseException``).
    DCP is imported here, not at funcopt's import (0.9 s per process that never checkpoints)."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


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


MAX_RECORD = 64 << 20
SAVE_ID = re.compile(r"^[0-9a-f]{32}$")


def read_record_file(file: str) -> Tuple[Dict[str, Any], Callable[[bool, str], None]]:
    """A JSON commit record and its ``need(cond, what)`` checker (``ValueError`` naming the file
    when ``cond`` is false); the shared checks (an object, a save id, a world size) done."""
    if os.path.getsize(file) > MAX_RECORD:
        raise ValueError(f"malformed commit record {file}: too large")
    try:
        with open(file, "rb") as fh:
            rec = json.loads(fh.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed commit record {file}: {e}") from None

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"malformed commit record {file}: {what}")

    need(isinstance(rec, dict), "not an object")
    need(isinstance(rec.get("save_id"), str) and bool(SAVE_ID.match(rec["save_id"])), "bad save_id")
    need(isinstance(rec.get("world_size"), int) and rec["world_size"] >= 1, "bad world_size")
    return rec, need


def check_file_entries(files: Any, names: Pattern[str], required: str, need: Callable[[bool, str], None]) -> None:
    """A record's ``files``: ``{name: {"size": int, "sha256": str}}``, names matching ``names``,
    ``required`` among them."""
    need(isinstance(files, dict) and required in files, "bad files")
    for name, info in files.items():
        need(isinstance(name, str) and bool(names.match(name)), f"bad file name {name!r}")
        need(isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str),
             f"bad entry for {name!r}")


def check_files(save_dir: str, present: List[str], files: Dict[str, Dict[str, Any]], rank: int, world: int,
                also: Sequence[str] = ()) -> None:
    """The files of a save against its record: ``present`` (what ``save_dir`` holds) exactly the
    record's, each of the recorded size; the checksums of this rank's share (``rank::world``)
    and of ``also``.  ``ValueError`` naming the first file that differs."""
    if sorted(present) != sorted(files):
        extra, missing = sorted(set(present) - set(files)), sorted(set(files) - set(present))
        raise ValueError(f"{save_dir} does not match its commit record (missing {missing}, unexpected {extra})")
    for name, info in files.items():
        size = os.path.getsize(os.path.join(save_dir, name))
        if size != info["size"]:
            raise ValueError(f"{os.path.join(save_dir, name)} has {size} bytes, the commit record says {info['size']} "
                             f"(truncated, or from another save)")
    names = sorted(files)
    for name in list(names[rank::world]) + [n for n in also if n not in names[rank::world]]:
        got = hash_file(os.path.join(save_dir, name))
        if got["sha256"] != files[name]["sha256"]:
            raise ValueError(f"{os.path.join(save_dir, name)} does not match the commit record "
                             f"(checksum differs: edited, or from another save)")

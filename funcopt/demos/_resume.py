"""What ``funcopt demo --zero/--fsdp2 --checkpoint-dir`` adds: the events log, the chaos plan, the state digest.

* :class:`Events`: rank 0 appends one JSON line per event to ``--events FILE``
  (``start`` with the step resumed from, ``step`` with the loss as a float hex,
  ``saved``): what ``benchmarks/chaos.py`` reads to count lost steps and compare
  loss curves.  Every line is written whole with one ``write`` and flushed, so a
  SIGKILL loses at most the event being written.
* :class:`ChaosPlan`: ``--chaos-plan FILE`` (JSON ``{"kills": [{"rank": r,
  "step": k, "phase": p, "action": "kill"|"enospc"}, ...]}``) makes rank ``r``
  SIGKILL itself at phase ``p`` with ``k`` steps done (``step-begin``,
  ``mid-step``: after backward, before ``optimizer.step``; or a
  :data:`~funcopt.distributed.checkpointer.PHASES` phase of a save), or makes its
  checkpoint file of that save a link to ``/dev/full`` (``enospc``: the kernel
  answers the write with "No space left on device").  Each entry fires once:
  ``FILE.fired-<i>`` is created before it acts, and a restarted rank skips it.
* :func:`state_digest`: SHA-256 of the final unsharded parameters, optimizer
  state and learning rates, the same on every rank (computed on rank 0 and
  broadcast), independent of restarts: two runs compare with ``diff``.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
from typing import Any, Dict, List, Optional

STEP_PHASES = ("step-begin", "mid-step")


class Events:
    """Rank 0's JSON-lines log (a no-op elsewhere or without a file)."""

    def __init__(self, path: Optional[str], rank: int):
        self.fh = open(path, "a", buffering=1) if path and rank == 0 else None

    def __call__(self, event: str, **fields: Any) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps(dict(event=event, pid=os.getpid(), **fields)) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


class ChaosPlan:
    """Fault injection for ``benchmarks/chaos.py`` and the chaos tests (see the module doc)."""

    def __init__(self, path: Optional[str], rank: int, events: Events):
        self.path, self.rank, self.events = path, rank, events
        self.kills: List[Dict[str, Any]] = []
        self.directory: Optional[str] = None  # the checkpoint directory (for enospc)
        if path:
            with open(path) as fh:
                self.kills = list(json.load(fh)["kills"])

    def __call__(self, phase: str, step: int) -> None:
        for i, kill in enumerate(self.kills):
            if kill["rank"] != self.rank or kill["step"] != step or kill["phase"] != phase:
                continue
            try:  # fire once, across restarts
                fd = os.open(f"{self.path}.fired-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
            except FileExistsError:
                continue
            action = kill.get("action", "kill")
            self.events("chaos", action=action, rank=self.rank, step=step, phase=phase)
            if action == "enospc":
                self._full_disk()
            else:
                os.kill(os.getpid(), signal.SIGKILL)

    def _full_disk(self) -> None:
        """This rank's file of the save in progress becomes a link to /dev/full (ENOSPC on write)."""
        assert self.directory is not None
        tmps = [n for n in os.listdir(self.directory) if n.startswith(".tmp-")]
        for name in tmps:
            for sub in ("sharded", "state"):
                where = os.path.join(self.directory, name, sub)
                os.makedirs(where, exist_ok=True)
                os.symlink("/dev/full", os.path.join(where, f"__{self.rank}_0.distcp"))


# ------------------------------------------------------------------- digest
def _feed(h: Any, obj: Any) -> None:
    import torch

    if isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(repr(str(k)).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, float):
        h.update(obj.hex().encode())
    else:
        h.update(repr(obj).encode())


def _zero3_state(torch: Any, model: Any, opt: Any) -> Dict[str, Any]:
    """Rank 0: the optimizer state of a ZeRO-3 root's chunks, unsharded ({} elsewhere)."""
    import torch.distributed as dist

    chunks = {id(c.tensor): c for c in model.sharded_chunks()}
    mine: Dict[str, Dict[str, Any]] = {}
    for p, st in opt.state.items():
        c = chunks[id(p)]
        mine[c.name] = {n: (c.offset, t.detach().reshape(-1)[: c.valid].clone())
                        if isinstance(t, torch.Tensor) and t.dim() > 0 else (None, t) for n, t in st.items()}
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: Dict[str, Dict[str, Any]] = {}
    for part in everyone:
        for name, entry in part.items():
            for key, (offset, t) in entry.items():
                out.setdefault(name, {}).setdefault(key, []).append((offset, t))
    full: Dict[str, Dict[str, Any]] = {}
    for name, entry in out.items():
        for key, pieces in entry.items():
            if pieces[0][0] is None:
                full.setdefault(name, {})[key] = pieces[0][1]
            else:
                full.setdefault(name, {})[key] = torch.cat([t for _, t in sorted(pieces, key=lambda x: x[0])])
    return full


def state_digest(torch: Any, mode: Any, model: Any, opt: Any, params: List[Any]) -> str:
    """SHA-256 (hex) of the unsharded parameters, optimizer state and learning rates; the
    same string on every rank.  Collective."""
    import torch.distributed as dist

    rank = dist.get_rank()
    lrs = [g["lr"] for g in opt.param_groups]
    if mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        what: Any = (msd, osd, lrs)
    elif mode == 3:
        msd = model.full_state_dict(to=0)
        what = (msd, _zero3_state(torch, model, opt), lrs)
    else:
        opt.consolidate_state_dict(to=0)
        what = ([p.detach() for p in params], opt.state_dict() if rank == 0 else None, lrs)
    box: List[Any] = [None]
    if rank == 0:
        h = hashlib.sha256()
        _feed(h, what)
        box[0] = h.hexdigest()
    dist.broadcast_object_list(box, src=0)
    return str(box[0])

"""Sharded optimizer checkpoints that load at any world size.

``save_sharded`` has every rank write only its own pieces of state, plus one
small ``meta.pt`` (rank 0) describing the parameters, the hyperparameters and
the layout.  ``load_sharded`` recomputes the saved layout from ``meta.pt``,
reads (memory-mapped) only the shard files that overlap the ranges this rank
owns now, and cuts its state out of them.  No rank ever holds the whole state.

Layout on disk::

    path/meta.pt                       # rank 0: format, algorithm, params, groups, layout
    path/shard-00000-of-00004.pt       # rank r: its (param, start, length, state) pieces
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
from torch.profiler import record_function

from . import _comm
from .layout import make_layout

FORMAT = "funcopt-zero-sharded-v1"


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def _describe(opt: Any) -> Dict[str, Any]:
    params = opt._params()
    groups, start = [], 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        packed["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(packed)
    return {
        "format": FORMAT,
        "algorithm": opt.spec.name,
        "world_size": opt.world_size,
        "partition": opt.partition,
        "params": [(tuple(p.shape), str(p.dtype)) for p in params],
        "param_groups": groups,
    }


def save_sharded(opt: Any, path: str) -> None:
    """Write this rank's shard (and, on rank 0, ``meta.pt``).  Collective."""
    with record_function("funcopt::zero/save_sharded"):
        meta = _describe(opt)
        meta["fingerprint"] = _comm.digest((meta["algorithm"], meta["params"], meta["world_size"]))
        error = None
        try:
            os.makedirs(path, exist_ok=True)
            shard = {"format": FORMAT, "rank": opt.rank, "world_size": opt.world_size,
                     "fingerprint": meta["fingerprint"], "pieces": opt._local_pieces()}
            torch.save(shard, os.path.join(path, shard_name(opt.rank, opt.world_size)))
            if opt.rank == 0:
                torch.save(meta, os.path.join(path, "meta.pt"))
        except OSError as e:
            error = f"cannot write {path}: {e}"
        _comm.agree(error, opt.process_group, "save_sharded")


def _read(file: str, what: str) -> Any:
    if not os.path.exists(file):
        raise ValueError(f"missing {what} {file}")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated / not a torch file / unpickling refused
        raise ValueError(f"corrupt {what} {file}: {type(e).__name__}: {str(e)[:200]}") from None


def _stage(opt: Any, path: str) -> Tuple[Dict[str, Any], Any]:
    meta = _read(os.path.join(path, "meta.pt"), "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a funcopt sharded checkpoint ({FORMAT})")
    mine = _describe(opt)
    if meta["algorithm"] != mine["algorithm"]:
        raise ValueError(f"checkpoint is for {meta['algorithm']}, optimizer is {mine['algorithm']}")
    if meta["params"] != mine["params"]:
        raise ValueError(
            f"checkpoint parameters differ from the optimizer's ({len(meta['params'])} saved, "
            f"{len(mine['params'])} here, or different shapes/dtypes): another model?"
        )
    if [len(g["params"]) for g in meta["param_groups"]] != [len(g["params"]) for g in mine["param_groups"]]:
        raise ValueError("checkpoint param groups differ from the optimizer's")
    old_world = int(meta["world_size"])
    shapes = [s for s, _ in meta["params"]]
    dtypes = [getattr(torch, d.replace("torch.", "")) for _, d in meta["params"]]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    old = make_layout(numels, dtypes, [len(g["params"]) for g in meta["param_groups"]], old_world, meta["partition"])
    wanted = {}
    for s in opt._segments:
        wanted.setdefault(s.param, []).append((s.start, s.start + s.length))
    needed = set()
    for r in range(old_world):
        for seg in old.segments(r):
            for a, b in wanted.get(seg.param, ()):
                if seg.start < b and a < seg.start + seg.length:
                    needed.add(r)
    pieces: List[Any] = []
    for r in sorted(needed):
        file = os.path.join(path, shard_name(r, old_world))
        shard = _read(file, "shard")
        if not isinstance(shard, dict) or shard.get("fingerprint") != meta["fingerprint"] or shard.get("rank") != r:
            raise ValueError(f"shard {file} does not belong to this checkpoint")
        pieces.extend(p for p in shard["pieces"] if p[0] in wanted)
    local_sd = opt._local_state_from_pieces(pieces)
    for gi, saved in enumerate(meta["param_groups"]):
        local_sd["param_groups"][gi].update({k: v for k, v in saved.items() if k != "params"})
    return meta, opt._local.stage_state(local_sd)


def load_sharded(opt: Any, path: str) -> None:
    """Load a checkpoint written by :func:`save_sharded` at any world size.  Collective.

    Every rank validates what it reads; if any rank fails (missing or corrupt
    shard, other model or algorithm) every rank raises and nothing changes.
    """
    with record_function("funcopt::zero/load_sharded"):
        error, staged = None, None
        try:
            staged = _stage(opt, path)
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            error = f"{type(e).__name__}: {e}"
        _comm.agree(error, opt.process_group, f"load_sharded({path!r})")
        assert staged is not None
        meta, local = staged
        for group, saved in zip(opt.param_groups, meta["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        opt._local.commit_state(local)

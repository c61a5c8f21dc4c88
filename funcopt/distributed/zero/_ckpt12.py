"""What a ZeRO-1/2 sharded checkpoint holds, for :mod:`funcopt.distributed.zero.checkpoint`.

Each elementwise state tensor of parameter ``i`` is one 1-D tensor
``state.<i>.<name>`` of the parameter's ``numel()`` elements, of which a rank
holds the ranges it owns, at their global offsets; 0-d values (``step``) are
replicated on every rank holding a piece; rank 0 adds ``param_groups`` (the
``torch.optim`` form) and ``funcopt`` (format, save id, algorithm, shapes).
A load asks for exactly the ranges the rank owns now, so a checkpoint loads at
any world size and partition.  Reads the optimizer through its public
interface only: ``algorithm()``, ``owned_ranges()``, ``shard_state()``,
``stage_shard_state()``, ``commit_shard_state()``, ``param_groups``, ``partition``.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Tuple

import torch

from ... import state_format

FORMAT = "funcopt-zero-dcp-v2"
_STATE_KEY = re.compile(r"^state\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)$")
_GROUP_KEY = re.compile(r"^param_groups\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)$")


def check_record(rec: Dict[str, Any], need: Callable[[bool, str], None]) -> None:
    """The record fields of this format (``need(cond, what)`` reports a malformed one)."""
    need(isinstance(rec.get("algorithm"), str), "bad algorithm")
    need(isinstance(rec.get("partition"), str), "bad partition")
    need(isinstance(rec.get("params"), list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], list) and all(isinstance(d, int) and d >= 0 for d in p[0])
        and isinstance(p[1], str) for p in rec["params"]), "bad params")
    need(isinstance(rec.get("group_sizes"), list) and all(isinstance(n, int) and n >= 0 for n in rec["group_sizes"])
         and sum(rec["group_sizes"]) == len(rec["params"]), "bad group_sizes")


class ZeroShards:
    """A :class:`~funcopt.distributed.ZeroRedundancyOptimizer` as a checkpoint target."""

    format = FORMAT

    def __init__(self, opt: Any):
        self.opt = opt
        self.process_group, self.rank, self.world_size = opt.process_group, opt.rank, opt.world_size
        self.params = [p for g in opt.param_groups for p in g["params"]]

    def describe(self) -> Dict[str, Any]:
        """What a checkpoint must match (JSON-friendly; goes into the commit record)."""
        return {"algorithm": self.opt.algorithm(), "partition": self.opt.partition,
                "params": [[list(p.shape), str(p.dtype)] for p in self.params],
                "group_sizes": [len(g["params"]) for g in self.opt.param_groups]}

    def save_dict(self, sharded: Callable[..., Any]) -> Dict[str, Any]:
        state: Dict[int, Dict[str, Any]] = {}
        for i, start, length, entry in self.opt.shard_state():
            numel = self.params[i].numel()
            out = state.setdefault(i, {})
            for name, t in entry.items():
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    out[name] = t  # replicated on every rank holding a piece of parameter i
                elif start == 0 and length == numel and t.numel() != length:
                    out[name] = t  # a whole parameter's own-shaped slot (Adafactor's rows/columns): its owner writes it
                elif t.numel() != length:
                    raise ValueError(f"state '{name}' of parameter {i} has {t.numel()} elements, not one per "
                                     f"element of the parameter ({length} here): cannot be sharded")
                elif numel == 0:
                    out[name] = t.reshape(0)
                else:
                    out[name] = sharded(t.reshape(-1), start, numel)
        sd: Dict[str, Any] = {"state": state}
        if self.rank == 0:
            sd["param_groups"] = state_format.pack_groups(self.opt.param_groups)
            sd["funcopt"] = {"algorithm": self.opt.algorithm(), "shapes": [tuple(p.shape) for p in self.params]}
        return sd

    def match(self, rec: Dict[str, Any]) -> None:
        mine = self.describe()
        if rec["algorithm"] != mine["algorithm"]:
            raise ValueError(f"checkpoint is for {rec['algorithm']}, optimizer is {mine['algorithm']}")
        if rec["params"] != mine["params"]:
            raise ValueError(f"checkpoint parameters differ from the optimizer's ({len(rec['params'])} saved, "
                             f"{len(mine['params'])} here, or different shapes/dtypes): another model?")
        if rec["group_sizes"] != mine["group_sizes"]:
            raise ValueError(f"checkpoint param groups {rec['group_sizes']} differ from the optimizer's {mine['group_sizes']}")

    def request(self, metadata: Any, sharded: Callable[..., Any]) -> Tuple[Dict[str, Any], Any]:
        """What this rank asks DCP for (its ranges of every saved state tensor, the groups), and the
        pieces those buffers form once loaded."""
        # DCP is imported by a load, not by funcopt's import (a second per process)
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
        params = self.params
        saved: Dict[int, Dict[str, Any]] = {}
        request: Dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            m = _STATE_KEY.match(key)
            if m:
                i = int(m.group(1))
                if i >= len(params):
                    raise ValueError(f"checkpoint entry {key!r} names no parameter")
                saved.setdefault(i, {})[m.group(2)] = md
            elif _GROUP_KEY.match(key) or key.startswith("funcopt."):
                if not isinstance(md, BytesStorageMetadata):
                    raise ValueError(f"checkpoint entry {key!r} is not a plain value")
                request[key] = None
            else:
                raise ValueError(f"unexpected checkpoint entry {key!r}")
        pieces = []
        for param, start, length in self.opt.owned_ranges():
            p = params[param]
            entry: Dict[str, Any] = {}
            for name, md in saved.get(param, {}).items():
                key = f"state.{param}.{name}"
                if isinstance(md, BytesStorageMetadata):  # a plain value (an eagerly run class's state)
                    request[key] = None
                    entry[name] = key
                    continue
                if len(md.size) == 0 or p.numel() == 0 or tuple(md.size) != (p.numel(),):
                    # 0-d, or a slot of its own shape, saved whole by the parameter's owner: read whole,
                    # and only where this rank owns the parameter whole (a whole-parameter rule's placement)
                    if len(md.size) > 0 and p.numel() > 0 and not (start == 0 and length == p.numel()):
                        raise ValueError(f"checkpoint entry {key!r} has shape {tuple(md.size)}: a slot of its own "
                                         f"shape, which needs parameter {param} whole on one rank (greedy "
                                         f"partition), but this rank holds elements {start}..{start + length} of "
                                         f"{p.numel()}")
                    buf = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=p.device)
                    request[key] = buf
                else:
                    buf = torch.empty(length, dtype=md.properties.dtype, device=p.device)
                    request[key] = sharded(buf, start, p.numel())
                entry[name] = buf
            if entry:
                pieces.append((param, start, length, entry))
        return request, pieces

    def stage(self, request: Dict[str, Any], pieces: Any) -> Any:
        pieces = [(i, a, n, {k: (request[v] if isinstance(v, str) else v) for k, v in e.items()})
                  for i, a, n, e in pieces]
        count = len(self.opt.param_groups)
        groups: List[Dict[str, Any]] = [{} for _ in range(count)]
        for key, value in request.items():
            m = _GROUP_KEY.match(key)
            if m:
                g = int(m.group(1))
                if g >= count:
                    raise ValueError(f"checkpoint has hyperparameters for param group {g}, optimizer has {count}")
                groups[g][m.group(2)] = value
        return self.opt.stage_shard_state(pieces, groups)

    def commit(self, staged: Any) -> None:
        self.opt.commit_shard_state(staged)

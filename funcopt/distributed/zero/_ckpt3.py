"""What a ZeRO-3 sharded checkpoint holds, for :mod:`funcopt.distributed.zero.checkpoint`.

A ZeRO-3 root lists its chunks with ``sharded_chunks()`` (each rank's piece of
every layer's flat trainable / frozen parameters: ``name``, ``tensor``,
``offset``, ``length``, ``valid``, ``numel``; see
``funcopt.distributed.zero.schedule3.ChunkInfo``).  Every chunk is saved as one
1-D tensor ``model.<chunk name>`` of its ``numel`` real elements (no padding,
so nothing depends on the world size), each rank writing its ``valid``
elements at ``offset``; buffers are replicated (``buffer.<name>``, written
once).  Given an optimizer over ``model.parameters()`` (funcopt or
``torch.optim``), each of its elementwise state tensors is saved the same way
under ``optim.state.<chunk name>.<state name>``, 0-d values (``step``) as they
are, and its hyperparameters as ``optim.groups``.  A load at another world
size asks for this rank's ranges of the same flats, so DCP reshards; padding
(parameters and state) is zero after a load.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ... import registry, state_format
from .._comm import rank_and_size

FORMAT = "funcopt-zero3-dcp-v1"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_record(rec: Dict[str, Any], need: Callable[[bool, str], None]) -> None:
    """The record fields of this format (``need(cond, what)`` reports a malformed one)."""
    chunks = rec.get("chunks")
    need(isinstance(chunks, list) and all(
        isinstance(c, list) and len(c) == 5 and isinstance(c[0], str) and isinstance(c[1], int) and c[1] >= 0
        and isinstance(c[2], str) and isinstance(c[3], bool) and isinstance(c[4], list) for c in chunks), "bad chunks")
    need(isinstance(rec.get("buffers"), list) and all(
        isinstance(b, list) and len(b) == 3 and isinstance(b[0], str) and isinstance(b[1], list)
        and isinstance(b[2], str) for b in rec["buffers"]), "bad buffers")
    opt = rec.get("optimizer")
    need(opt is None or (isinstance(opt, dict) and isinstance(opt.get("algorithm"), str)
                         and isinstance(opt.get("params"), list) and all(isinstance(p, str) for p in opt["params"])
                         and isinstance(opt.get("group_sizes"), list)), "bad optimizer")


def _algorithm(opt: Any) -> str:
    try:
        return registry.get(type(opt)).name
    except KeyError:
        return f"{type(opt).__module__}.{type(opt).__qualname__}"


class Zero3Shards:
    """A ZeRO-3 root (and optionally its optimizer) as a checkpoint target.

    Reads the root through its public interface only: ``sharded_chunks()``,
    ``named_buffers()``, ``process_group``."""

    format = FORMAT

    def __init__(self, root: Any, optimizer: Any = None):
        if optimizer is not None:  # before anything is read or any rank is waited for
            registry.refuse_out_of_scope(
                optimizer, "save_sharded/load_sharded(optimizer=...)",
                also="; or any other torch.optim.Optimizer whose update is per parameter")
        self.root, self.optimizer = root, optimizer
        self.process_group = getattr(root, "process_group", None)
        self.rank, self.world_size = rank_and_size(self.process_group)
        self.chunks = list(root.sharded_chunks())
        self.buffers = list(root.named_buffers())
        by_id = {id(c.tensor): c for c in self.chunks}
        self.opt_chunks: List[Any] = []  # the chunk of each optimizer parameter, in its order
        if optimizer is not None:
            for g, group in enumerate(optimizer.param_groups):
                for k, p in enumerate(group["params"]):
                    if id(p) not in by_id:
                        raise ValueError(f"optimizer parameter {k} of group {g} (shape {tuple(p.shape)}) is not one "
                                         f"of the model's chunks: build the optimizer on model.parameters()")
                    self.opt_chunks.append(by_id[id(p)])

    def describe(self) -> Dict[str, Any]:
        """What a checkpoint must match (JSON-friendly, independent of the world size)."""
        opt = None
        if self.optimizer is not None:
            opt = {"algorithm": _algorithm(self.optimizer), "params": [c.name for c in self.opt_chunks],
                   "group_sizes": [len(g["params"]) for g in self.optimizer.param_groups]}
        return {"chunks": [[c.name, int(c.numel), str(c.tensor.dtype), bool(c.trainable),
                            [[k, int(o), list(s)] for k, o, s in c.params]] for c in self.chunks],
                "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in self.buffers],
                "optimizer": opt}

    # ------------------------------------------------------------------ save
    def save_dict(self, sharded: Callable[..., Any]) -> Dict[str, Any]:
        sd: Dict[str, Any] = {}
        for c in self.chunks:
            if c.valid > 0:
                sd[f"model.{c.name}"] = sharded(c.tensor.detach()[: c.valid], c.offset, c.numel)
        if self.rank == 0:
            for n, b in self.buffers:
                sd[f"buffer.{n}"] = b.detach()
        if self.optimizer is not None:
            osd = self.optimizer.state_dict()
            for j, entry in osd["state"].items():
                c = self.opt_chunks[j]
                for name, t in entry.items():
                    if not _NAME.match(str(name)):
                        raise ValueError(f"optimizer state name {name!r} of {c.name} cannot be checkpointed")
                    key = f"optim.state.{c.name}.{name}"
                    if isinstance(t, Tensor) and t.dim() > 0:
                        if t.numel() != c.length:
                            raise ValueError(f"optimizer state '{name}' of {c.name} has {t.numel()} elements, not "
                                             f"one per chunk element ({c.length}): cannot be sharded")
                        if c.valid > 0:
                            sd[key] = sharded(t.detach().reshape(-1)[: c.valid], c.offset, c.numel)
                    else:
                        sd[key] = t  # 0-d (step) or a plain value: the same on every rank
            if self.rank == 0:
                # a tuple is one value for DCP (pickled whole), not traversed
                sd["optim.groups"] = tuple(state_format.hyperparameters(g) for g in osd["param_groups"])
        return sd

    # ------------------------------------------------------------------ load
    def match(self, rec: Dict[str, Any]) -> None:
        mine = self.describe()
        if rec["chunks"] != mine["chunks"]:
            saved = {c[0]: c for c in rec["chunks"]}
            diff = [c[0] for c in mine["chunks"] if saved.get(c[0]) != c] + \
                   [n for n in saved if n not in {c[0] for c in mine["chunks"]}]
            raise ValueError(f"checkpoint model differs from this one (chunks {diff[:4]} differ in size, dtype or "
                             f"the parameters in them): another model?")
        if rec["buffers"] != mine["buffers"]:
            raise ValueError("checkpoint buffers differ from the model's (names, shapes or dtypes): another model?")
        if self.optimizer is None:
            return
        if rec["optimizer"] is None:
            raise ValueError("the checkpoint holds no optimizer state (saved without optimizer=)")
        saved, here = rec["optimizer"], mine["optimizer"]
        if saved["algorithm"] != here["algorithm"]:
            raise ValueError(f"checkpoint is for {saved['algorithm']}, optimizer is {here['algorithm']}")
        if saved["params"] != here["params"] or saved["group_sizes"] != here["group_sizes"]:
            raise ValueError(f"checkpoint optimizer steps chunks {saved['params']} in groups {saved['group_sizes']}, "
                             f"this one {here['params']} in groups {here['group_sizes']}")

    def request(self, metadata: Any, sharded: Callable[..., Any]) -> Tuple[Dict[str, Any], Any]:
        # DCP is imported by a load, not by funcopt's import (a second per process)
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
        md = metadata.state_dict_metadata
        request: Dict[str, Any] = {}
        model: List[Tuple[Any, Optional[Tensor]]] = []
        for c in self.chunks:
            key = f"model.{c.name}"
            buf = None
            if key not in md:
                raise ValueError(f"checkpoint lacks {key!r}")
            if c.valid > 0:
                buf = torch.empty(c.valid, dtype=c.tensor.dtype, device=c.tensor.device)
                request[key] = sharded(buf, c.offset, c.numel)
            model.append((c, buf))
        buffers = []
        for n, b in self.buffers:
            key = f"buffer.{n}"
            if not isinstance(md.get(key), TensorStorageMetadata):
                raise ValueError(f"checkpoint lacks buffer {key!r}")
            buf = torch.empty_like(b)
            request[key] = buf
            buffers.append((b, buf))
        state: Dict[int, Dict[str, Any]] = {}
        if self.optimizer is not None:
            if not isinstance(md.get("optim.groups"), BytesStorageMetadata):
                raise ValueError("checkpoint lacks the optimizer's hyperparameters ('optim.groups')")
            request["optim.groups"] = None
            for j, c in enumerate(self.opt_chunks):
                prefix = f"optim.state.{c.name}."
                for key, m in md.items():
                    if not key.startswith(prefix) or not _NAME.match(key[len(prefix):]):
                        continue
                    name = key[len(prefix):]
                    if isinstance(m, BytesStorageMetadata):
                        request[key] = None
                        state.setdefault(j, {})[name] = key
                    elif len(m.size) == 0:
                        request[key] = torch.empty((), dtype=m.properties.dtype, device=c.tensor.device)
                        state.setdefault(j, {})[name] = request[key]
                    elif tuple(m.size) != (c.numel,):
                        raise ValueError(f"checkpoint entry {key!r} has shape {tuple(m.size)}, expected ({c.numel},)")
                    else:
                        full = torch.zeros(c.length, dtype=m.properties.dtype, device=c.tensor.device)
                        if c.valid > 0:
                            request[key] = sharded(full[: c.valid], c.offset, c.numel)
                        state.setdefault(j, {})[name] = full
        return request, (model, buffers, state)

    def stage(self, request: Dict[str, Any], ctx: Any) -> Any:
        model, buffers, state = ctx
        staged_opt = None
        if self.optimizer is not None:
            groups = request["optim.groups"]
            if not isinstance(groups, tuple) or len(groups) != len(self.optimizer.param_groups):
                raise ValueError("checkpoint optimizer groups do not match the optimizer's")
            ids, pg = 0, []
            for saved, mine in zip(groups, self.optimizer.param_groups):
                pg.append(dict(saved, params=list(range(ids, ids + len(mine["params"])))))
                ids += len(mine["params"])
            sd = {"state": {j: {n: (request[v] if isinstance(v, str) else v) for n, v in e.items()}
                            for j, e in state.items()},
                  "param_groups": pg}
            staged_opt = self._stage_optimizer(sd)
        return model, buffers, staged_opt

    def _stage_optimizer(self, sd: Dict[str, Any]) -> Any:
        """Check ``sd`` against the optimizer without changing it."""
        opt = self.optimizer
        if callable(getattr(opt, "stage_state", None)) and callable(getattr(opt, "commit_state", None)):
            return ("funcopt", opt.stage_state(sd))
        # a torch.optim class checks a load only by doing it: on a scratch copy
        groups = [dict(state_format.hyperparameters(g),
                       params=[p.detach().clone().requires_grad_(p.requires_grad) for p in g["params"]])
                  for g in opt.param_groups]
        type(opt)(groups, **opt.defaults).load_state_dict(sd)
        return ("torch", sd)

    @torch.no_grad()
    def commit(self, staged: Any) -> None:
        model, buffers, staged_opt = staged
        for c, buf in model:
            if buf is not None:
                c.tensor[: c.valid].copy_(buf)
            c.tensor[c.valid:].zero_()
        for b, buf in buffers:
            b.copy_(buf)
        if staged_opt is not None:
            kind, value = staged_opt
            if kind == "funcopt":
                self.optimizer.commit_state(value)
            else:
                self.optimizer.load_state_dict(value)

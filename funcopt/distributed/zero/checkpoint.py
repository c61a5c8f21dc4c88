"""Sharded optimizer checkpoints through ``torch.distributed.checkpoint``, published atomically.

``save_sharded`` has every rank hand DCP (``dcp.save`` with a
``FileSystemWriter``) only its own pieces of state: each elementwise state
tensor of a parameter is one 1-D tensor of the parameter's ``numel()``
elements, of which a rank holds the ranges it owns, at their global offsets
(a ``DTensor`` over a ``LocalShardsWrapper``, the uneven-shard form DCP
reshards).  ``load_sharded`` asks DCP for exactly the ranges this rank owns
now, so a checkpoint loads at any world size and partition, and no rank ever
holds (or reads) the whole state.

Atomicity: DCP writes into a temporary directory; when every rank has written
and checksummed its files, rank 0 renames it to ``save-<id>`` and publishes the
save by atomically replacing ``COMMIT.json``, the commit record naming the save
(a unique id, every file's size and SHA-256).  Only then are older saves
removed.  A crash at any point leaves either the old or the new save
committed, never a mix; ``load_sharded`` reads only the save the record names,
and only after every file matched the record.

Layout on disk::

    path/COMMIT.json              # the commit record (format, save id, directory, model, files)
    path/save-<id>/.metadata      # DCP's metadata
    path/save-<id>/__<r>_0.distcp # rank r's pieces (and, for rank 0, the param groups)

Offline, the committed save converts to one ``torch.optim`` state dict with
DCP's own ``dcp_to_torch_save`` plus :func:`to_torch_state_dict`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.profiler import record_function

from ... import state_format
from .. import _comm
from .._comm import DistributedError

FORMAT = "funcopt-zero-dcp-v2"
COMMIT = "COMMIT.json"
SAVE_PREFIX = "save-"
TMP_PREFIX = ".tmp-save-"
_ID = re.compile(r"^[0-9a-f]{32}$")
_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
_STATE_KEY = re.compile(r"^state\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)$")
_GROUP_KEY = re.compile(r"^param_groups\.(\d+)\.([A-Za-z_][A-Za-z0-9_]*)$")
_MAX_RECORD = 64 << 20
# DCP's CheckpointException (every rank's failures, raised on every rank) is a BaseException
_FAILURES = (Exception, CheckpointException)


# ------------------------------------------------------------------ helpers
def _what(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: WrappedException}
    if isinstance(failures, dict) and failures:
        excs = {r: (w[0] if isinstance(w, tuple) else getattr(w, "exc", w)) for r, w in failures.items()}
        inner = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(excs.items()))
        return f"torch.distributed.checkpoint failed ({inner})"[:2000]
    return f"{type(e).__name__}: {e}"[:2000]


def _agree(group: Any, error: Optional[str], what: str, value: Any = None) -> List[Any]:
    """Collective: every rank's ``value``; ``DistributedError`` on every rank, with the
    same message, if any rank has an ``error``.  Call on every rank."""
    got = _comm.all_gather_object((error, value), group)
    bad = [f"rank {r}: {e}" for r, (e, _) in enumerate(got) if e is not None]
    if bad:
        raise DistributedError(f"{what} failed on {len(bad)} of {len(got)} ranks: " + "; ".join(bad))
    return [v for _, v in got]


def _hash(file: str, sync: bool = False) -> Dict[str, Any]:
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            size += len(block)
        if sync:
            os.fsync(fh.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _params(opt: Any) -> List[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _describe(opt: Any) -> Dict[str, Any]:
    """What a checkpoint must match (JSON-friendly)."""
    return {
        "algorithm": opt.algorithm(),
        "params": [[list(p.shape), str(p.dtype)] for p in _params(opt)],
        "group_sizes": [len(g["params"]) for g in opt.param_groups],
    }


def _torch_groups(opt: Any) -> List[Dict[str, Any]]:
    """``param_groups`` in torch.optim's state-dict form (as ``consolidate_state_dict`` gives)."""
    return state_format.pack_groups(opt.param_groups)


class _Meshes:
    """1-D device meshes over ``group``, one per device type of the local tensors (DTensor
    would copy a local tensor to its mesh's device type, and a load must land in ours)."""

    def __init__(self, group: Any):
        self.group = group if group is not None else torch.distributed.group.WORLD
        self.meshes: Dict[str, Any] = {}

    def __call__(self, device: torch.device) -> Any:
        from torch.distributed.device_mesh import DeviceMesh
        if device.type not in self.meshes:
            self.meshes[device.type] = DeviceMesh.from_group(self.group, device.type)
        return self.meshes[device.type]


def _sharded(local: torch.Tensor, start: int, numel: int, meshes: _Meshes) -> torch.Tensor:
    """Elements ``[start, start + len(local))`` of a 1-D tensor of ``numel`` elements, as DCP sees it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    wrapped = LocalShardsWrapper([local], [(start,)])
    return DTensor.from_local(wrapped, meshes(local.device), [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


# --------------------------------------------------------------------- save
def _save_state_dict(opt: Any, save_id: Optional[str]) -> Dict[str, Any]:
    params = _params(opt)
    meshes = _Meshes(opt.process_group)
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    for i, start, length, entry in opt.shard_state():
        numel = params[i].numel()
        out = state.setdefault(i, {})
        for name, t in entry.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                out[name] = t  # replicated on every rank holding a piece of parameter i
            elif t.numel() != length:
                raise ValueError(f"state '{name}' of parameter {i} has {t.numel()} elements, not one per "
                                 f"element of the parameter ({length} here): cannot be sharded")
            elif numel == 0:
                out[name] = t.reshape(0)
            else:
                out[name] = _sharded(t.reshape(-1), start, numel, meshes)
    sd: Dict[str, Any] = {"state": state}
    if opt.rank == 0:
        sd["param_groups"] = _torch_groups(opt)
        sd["funcopt"] = {"format": FORMAT, "save_id": save_id, "algorithm": opt.algorithm(),
                         "shapes": [tuple(p.shape) for p in params]}
    return sd


def _own_files(tmp: str, rank: int) -> Dict[str, Dict[str, Any]]:
    mine = {}
    for name in sorted(os.listdir(tmp)):
        if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata"):
            mine[name] = _hash(os.path.join(tmp, name), sync=True)
    return mine


def _publish(path: str, save_id: str, record: Dict[str, Any]) -> None:
    """Rank 0: rename the written save into place, replace the commit record, drop older saves."""
    tmp, final = os.path.join(path, TMP_PREFIX + save_id), os.path.join(path, SAVE_PREFIX + save_id)
    listed = sorted(os.listdir(tmp))
    if listed != sorted(record["files"]):
        raise RuntimeError(f"files written {listed} differ from the files checksummed {sorted(record['files'])}")
    os.rename(tmp, final)
    _fsync_dir(path)
    staging = os.path.join(path, f".{COMMIT}.{save_id}")
    with open(staging, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staging, os.path.join(path, COMMIT))  # the commit point
    _fsync_dir(path)
    _collect(path, keep=SAVE_PREFIX + save_id)


def _collect(path: str, keep: str) -> None:
    """Remove saves other than ``keep`` and leftovers of interrupted saves (best effort)."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name != keep and (name.startswith(SAVE_PREFIX) or name.startswith(TMP_PREFIX)) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif name.startswith(f".{COMMIT}."):
            try:
                os.remove(full)
            except OSError:
                pass


def _discard(path: str, save_id: str) -> None:
    """Rank 0, after a failed save: remove its files unless the record already names it."""
    shutil.rmtree(os.path.join(path, TMP_PREFIX + save_id), ignore_errors=True)
    try:
        committed = read_record(path)["save_id"]
    except (OSError, ValueError):
        committed = None
    if committed != save_id:
        shutil.rmtree(os.path.join(path, SAVE_PREFIX + save_id), ignore_errors=True)


def save_sharded(opt: Any, path: str) -> None:
    """Write ``opt``'s state under directory ``path``, each rank its own pieces.

    The save becomes visible at once, when its commit record replaces the
    previous one; an existing checkpoint at ``path`` stays loadable until then.
    One save at a time per ``path``.

    Raises:
      DistributedError: on every rank, with the same message, if any rank
        failed (full disk, permissions, any exception); the checkpoint that
        was committed before (if any) is still the one ``path`` holds.

    .. warning:: collective: call on every rank of ``opt``'s process group.
    """
    group = opt.process_group
    what = f"save_sharded({path!r})"
    with record_function("funcopt::zero/save_sharded"):
        # everything that can fail locally before DCP's collectives is agreed on first:
        # a rank must never leave while its peers wait inside dcp.save
        error, save_id, sd, created = None, None, None, None
        try:
            if opt.rank == 0:
                save_id = uuid.uuid4().hex
                os.makedirs(path, exist_ok=True)
                os.mkdir(os.path.join(path, TMP_PREFIX + save_id))
                created = os.path.join(path, TMP_PREFIX + save_id)
            sd = _save_state_dict(opt, save_id)
        except _FAILURES as e:
            error = _what(e)
        try:
            save_id = _agree(group, error, what, save_id)[0]
            tmp = os.path.join(path, TMP_PREFIX + save_id)
            error, files = None, None
            with record_function("funcopt::zero/save_sharded/write"):
                try:
                    dcp.save(sd, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                             process_group=group)
                    files = _own_files(tmp, opt.rank)
                except _FAILURES as e:
                    error = _what(e)
                parts = _agree(group, error, what, files)
            error = None
            with record_function("funcopt::zero/save_sharded/publish"):
                if opt.rank == 0:
                    try:
                        record = dict(_describe(opt), format=FORMAT, save_id=save_id, dir=SAVE_PREFIX + save_id,
                                      world_size=opt.world_size, partition=opt.partition,
                                      files={k: v for part in parts for k, v in part.items()})
                        _publish(path, save_id, record)
                    except _FAILURES as e:
                        error = _what(e)
                _agree(group, error, what)
        except DistributedError:
            if created is not None:
                _discard(path, save_id)
            raise


# --------------------------------------------------------------------- load
def read_record(path: str) -> Dict[str, Any]:
    """The commit record of the checkpoint at ``path``, checked for shape (``ValueError`` if bad).  Local."""
    file = os.path.join(path, COMMIT)
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, "meta.pt")):
            raise ValueError(f"{path} holds an old-format (funcopt-zero-sharded-v1) checkpoint, "
                             f"which has no commit record; re-save it with this version")
        raise ValueError(f"no committed save at {path} (missing {COMMIT})")
    if os.path.getsize(file) > _MAX_RECORD:
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
    need(rec.get("format") == FORMAT, f"format {rec.get('format')!r}, expected {FORMAT!r}")
    need(isinstance(rec.get("save_id"), str) and bool(_ID.match(rec["save_id"])), "bad save_id")
    need(rec.get("dir") == SAVE_PREFIX + rec["save_id"], "dir does not name the save")
    need(isinstance(rec.get("algorithm"), str), "bad algorithm")
    need(isinstance(rec.get("world_size"), int) and rec["world_size"] >= 1, "bad world_size")
    need(isinstance(rec.get("partition"), str), "bad partition")
    need(isinstance(rec.get("params"), list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], list) and all(isinstance(d, int) and d >= 0 for d in p[0])
        and isinstance(p[1], str) for p in rec["params"]), "bad params")
    need(isinstance(rec.get("group_sizes"), list) and all(isinstance(n, int) and n >= 0 for n in rec["group_sizes"])
         and sum(rec["group_sizes"]) == len(rec["params"]), "bad group_sizes")
    files = rec.get("files")
    need(isinstance(files, dict) and ".metadata" in files, "bad files")
    for name, info in files.items():
        need(isinstance(name, str) and bool(_FILE.match(name)), f"bad file name {name!r}")
        need(isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str),
             f"bad entry for {name!r}")
    return rec


def _check_file(save_dir: str, name: str, info: Dict[str, Any]) -> None:
    got = _hash(os.path.join(save_dir, name))
    if got != {"size": info["size"], "sha256": info["sha256"]}:
        raise ValueError(f"{os.path.join(save_dir, name)} does not match the commit record "
                         f"(size {got['size']} vs {info['size']}, checksum differs: edited, or from another save)")


def _verify(path: str, rank: int, world: int) -> Tuple[Dict[str, Any], str]:
    """Check the record and the files it names: sizes everywhere, checksums split over ranks."""
    rec = read_record(path)
    save_dir = os.path.join(path, rec["dir"])
    if not os.path.isdir(save_dir):
        raise ValueError(f"the committed save {save_dir} is missing")
    present = sorted(os.listdir(save_dir))
    if present != sorted(rec["files"]):
        extra, missing = sorted(set(present) - set(rec["files"])), sorted(set(rec["files"]) - set(present))
        raise ValueError(f"{save_dir} does not match its commit record (missing {missing}, unexpected {extra})")
    for name, info in rec["files"].items():
        size = os.path.getsize(os.path.join(save_dir, name))
        if size != info["size"]:
            raise ValueError(f"{os.path.join(save_dir, name)} has {size} bytes, the commit record says {info['size']} "
                             f"(truncated, or from another save)")
    names = sorted(rec["files"])
    for name in names[rank::world]:
        _check_file(save_dir, name, rec["files"][name])
    if ".metadata" not in names[rank::world]:
        _check_file(save_dir, ".metadata", rec["files"][".metadata"])  # every rank unpickles it next
    return rec, save_dir


def _match(opt: Any, rec: Dict[str, Any]) -> None:
    mine = _describe(opt)
    if rec["algorithm"] != mine["algorithm"]:
        raise ValueError(f"checkpoint is for {rec['algorithm']}, optimizer is {mine['algorithm']}")
    if rec["params"] != mine["params"]:
        raise ValueError(f"checkpoint parameters differ from the optimizer's ({len(rec['params'])} saved, "
                         f"{len(mine['params'])} here, or different shapes/dtypes): another model?")
    if rec["group_sizes"] != mine["group_sizes"]:
        raise ValueError(f"checkpoint param groups {rec['group_sizes']} differ from the optimizer's {mine['group_sizes']}")


def _load_request(opt: Any, metadata: Any) -> Tuple[Dict[str, Any], List[Tuple[int, int, int, Dict[str, torch.Tensor]]]]:
    """What this rank asks DCP for (its ranges of every saved state tensor, the groups), and the
    pieces those buffers form once loaded."""
    params = _params(opt)
    meshes = _Meshes(opt.process_group)
    saved: Dict[int, Dict[str, Any]] = {}
    request: Dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        m = _STATE_KEY.match(key)
        if m:
            i = int(m.group(1))
            if i >= len(params):
                raise ValueError(f"checkpoint entry {key!r} names no parameter")
            if isinstance(md, TensorStorageMetadata) and tuple(md.size) not in ((), (params[i].numel(),)):
                raise ValueError(f"checkpoint entry {key!r} has shape {tuple(md.size)}, expected () or "
                                 f"({params[i].numel()},)")
            saved.setdefault(i, {})[m.group(2)] = md
        elif _GROUP_KEY.match(key) or key.startswith("funcopt."):
            if not isinstance(md, BytesStorageMetadata):
                raise ValueError(f"checkpoint entry {key!r} is not a plain value")
            request[key] = None
        else:
            raise ValueError(f"unexpected checkpoint entry {key!r}")
    if "funcopt.save_id" not in request:
        raise ValueError("the checkpoint lacks its save id")
    pieces = []
    for param, start, length in opt.owned_ranges():
        p = params[param]
        entry = {}
        for name, md in saved.get(param, {}).items():
            key = f"state.{param}.{name}"
            if isinstance(md, BytesStorageMetadata):  # a plain value (an eagerly run class's state)
                request[key] = None
                entry[name] = key
                continue
            if len(md.size) == 0 or p.numel() == 0:
                buf = torch.empty(tuple(md.size), dtype=md.properties.dtype, device=p.device)
                request[key] = buf
            else:
                buf = torch.empty(length, dtype=md.properties.dtype, device=p.device)
                request[key] = _sharded(buf, start, p.numel(), meshes)
            entry[name] = buf
        if entry:
            pieces.append((param, start, length, entry))
    return request, pieces


def _groups(request: Dict[str, Any], count: int) -> List[Dict[str, Any]]:
    groups: List[Dict[str, Any]] = [{} for _ in range(count)]
    for key, value in request.items():
        m = _GROUP_KEY.match(key)
        if m:
            g = int(m.group(1))
            if g >= count:
                raise ValueError(f"checkpoint has hyperparameters for param group {g}, optimizer has {count}")
            groups[g][m.group(2)] = value
    return groups


def load_sharded(opt: Any, path: str) -> None:
    """Load the committed save at ``path`` (written by :func:`save_sharded` at any world size
    and partition) into ``opt``: its state and its hyperparameters.

    Only a complete, committed save is accepted: every file must match the
    commit record (size and checksum; each rank checksums a share of the files)
    and the checkpoint must be for the same algorithm, parameter shapes and
    dtypes, and group sizes.

    Raises:
      DistributedError: on every rank, with the same message, if any rank
        found a problem; no rank has changed anything.

    .. warning:: collective: call on every rank of ``opt``'s process group.
    """
    group = opt.process_group
    what = f"load_sharded({path!r})"
    with record_function("funcopt::zero/load_sharded"):
        error, plan = None, None
        with record_function("funcopt::zero/load_sharded/verify"):
            try:
                rec, save_dir = _verify(path, opt.rank, opt.world_size)
                _match(opt, rec)
                metadata = FileSystemReader(save_dir).read_metadata()
                plan = (rec, save_dir) + _load_request(opt, metadata)
            except _FAILURES as e:
                error = _what(e)
            _agree(group, error, what)
        assert plan is not None
        rec, save_dir, request, pieces = plan
        error, staged = None, None
        with record_function("funcopt::zero/load_sharded/read"):
            try:
                dcp.load(request, storage_reader=FileSystemReader(save_dir), process_group=group,
                         planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
                if request.get("funcopt.save_id") != rec["save_id"]:
                    raise ValueError(f"{save_dir} holds save {request.get('funcopt.save_id')!r}, "
                                     f"the commit record names {rec['save_id']!r}")
                pieces = [(i, a, n, {k: (request[v] if isinstance(v, str) else v) for k, v in e.items()})
                          for i, a, n, e in pieces]
                staged = opt.stage_shard_state(pieces, _groups(request, len(opt.param_groups)))
            except _FAILURES as e:
                error = _what(e)
            _agree(group, error, what)
        opt.commit_shard_state(staged)


# ------------------------------------------------------------------ offline
def committed_dir(path: str) -> str:
    """The DCP directory of the committed save at ``path``, after checking every file against
    the commit record.  Offline (no process group)."""
    rec, save_dir = _verify(path, 0, 1)
    return save_dir


def to_torch_state_dict(converted: Dict[str, Any]) -> Dict[str, Any]:
    """The small step after ``dcp_to_torch_save``: DCP's nested dict -> a ``torch.optim`` state dict.

    DCP gives back ``{"state": {"<i>": {name: 1-D tensor}}, "param_groups": [...],
    "funcopt": {..., "shapes": [...]}}``; this turns the ids into ints and each
    elementwise state tensor into its parameter's shape.
    """
    shapes = converted["funcopt"]["shapes"]
    state = {}
    for i, entry in sorted(converted.get("state", {}).items(), key=lambda kv: int(kv[0])):
        state[int(i)] = {n: (t.view(shapes[int(i)]) if t.dim() == 1 else t) for n, t in entry.items()}
    return {"state": state, "param_groups": converted["param_groups"]}

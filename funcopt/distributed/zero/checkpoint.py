"""Sharded checkpoints through ``torch.distributed.checkpoint``, published atomically.

One checkpoint layer for every ZeRO stage.  ``save_sharded`` has every rank
hand DCP (``dcp.save`` with a ``FileSystemWriter``) only its own pieces: each
sharded tensor is one 1-D tensor of its global number of elements, of which a
rank holds the ranges it owns, at their global offsets (a ``DTensor`` over a
``LocalShardsWrapper``, the uneven-shard form DCP reshards).  ``load_sharded``
asks DCP for exactly the ranges this rank owns now, so a checkpoint loads at
any world size (and, for ZeRO-1/2, any partition), and no rank ever holds (or
reads) the whole state.

What is saved:

* a :class:`~funcopt.distributed.ZeroRedundancyOptimizer` (ZeRO-1/2): its
  optimizer state and hyperparameters (format ``funcopt-zero-dcp-v2``);
* a ZeRO-3 root (``Zero3Sequential`` or what ``zero3`` returns): its
  parameter chunks and buffers, and given an optimizer over
  ``model.parameters()``, that optimizer's state and hyperparameters (format
  ``funcopt-zero3-dcp-v1``).

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

Offline, a committed ZeRO-1/2 save converts to one ``torch.optim`` state dict
with DCP's own ``dcp_to_torch_save`` plus :func:`to_torch_state_dict`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Dict, Tuple

import torch
from torch.profiler import record_function

from .._comm import DistributedError
from .._comm import agree_values as _agree
from .._files import failures as _failures
from .._files import failure_text as _what
from .._files import fsync_dir as _fsync_dir
from .._files import hash_file as _hash
from .._files import check_file_entries, check_files, read_record_file
from . import _ckpt3, _ckpt12

FORMAT = _ckpt12.FORMAT
FORMAT3 = _ckpt3.FORMAT
_FORMATS = {FORMAT: _ckpt12.check_record, FORMAT3: _ckpt3.check_record}
COMMIT = "COMMIT.json"
SAVE_PREFIX = "save-"
TMP_PREFIX = ".tmp-save-"
_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")


# ------------------------------------------------------------------ helpers
def _dcp() -> Any:
    """torch.distributed.checkpoint, imported by the first save or load (not by funcopt's
    import: it pulls DTensor in, about a second per process)."""
    import torch.distributed.checkpoint as dcp
    return dcp


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


def _sharder(group: Any) -> Any:
    """``sharded(local, start, numel)``: elements ``[start, start + len(local))`` of a 1-D
    tensor of ``numel`` elements, as DCP sees it (a DTensor over a LocalShardsWrapper)."""
    meshes = _Meshes(group)

    def sharded(local: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
        wrapped = LocalShardsWrapper([local], [(start,)])
        return DTensor.from_local(wrapped, meshes(local.device), [Shard(0)], run_check=False,
                                  shape=torch.Size([numel]), stride=(1,))
    return sharded


def _target(obj: Any, optimizer: Any) -> Any:
    """The checkpoint target: what :mod:`._ckpt12` / :mod:`._ckpt3` make of ``obj``."""
    if callable(getattr(obj, "sharded_chunks", None)):
        return _ckpt3.Zero3Shards(obj, optimizer)
    if optimizer is not None:
        raise TypeError("save_sharded/load_sharded(opt, path): optimizer= is for ZeRO-3 models; a "
                        "ZeroRedundancyOptimizer is the optimizer")
    return _ckpt12.ZeroShards(obj)


# --------------------------------------------------------------------- save
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


def save_sharded(obj: Any, path: str, optimizer: Any = None) -> None:
    """Write ``obj``'s shards under directory ``path``, each rank its own pieces.

    ``obj`` is a ``ZeroRedundancyOptimizer`` (its state), or a ZeRO-3 root
    (its chunks and buffers, and ``optimizer``'s state when given: an optimizer
    over ``obj.parameters()``).  The save becomes visible at once, when its
    commit record replaces the previous one; an existing checkpoint at
    ``path`` stays loadable until then.  One save at a time per ``path``.

    Args:
      obj: what to save (see above).
      path: a directory (created if missing).
      optimizer: ZeRO-3 only; default ``None`` (the model alone).

    Raises:
      DistributedError: on every rank, with the same message, if any rank
        failed (full disk, permissions, any exception); the checkpoint that
        was committed before (if any) is still the one ``path`` holds.

    .. warning:: collective: call on every rank of ``obj``'s process group.
    """
    target = _target(obj, optimizer)
    group = target.process_group
    what = f"save_sharded({path!r})"
    with record_function("funcopt::zero/save_sharded"):
        # everything that can fail locally before DCP's collectives is agreed on first:
        # a rank must never leave while its peers wait inside dcp.save
        error, save_id, sd, created = None, None, None, None
        try:
            if target.rank == 0:
                save_id = uuid.uuid4().hex
                os.makedirs(path, exist_ok=True)
                os.mkdir(os.path.join(path, TMP_PREFIX + save_id))
                created = os.path.join(path, TMP_PREFIX + save_id)
            sd = target.save_dict(_sharder(group))
            if target.rank == 0:
                sd.setdefault("funcopt", {}).update(format=target.format, save_id=save_id)
        except _failures() as e:
            error = _what(e)
        try:
            save_id = _agree(group, error, what, save_id)[0]
            tmp = os.path.join(path, TMP_PREFIX + save_id)
            error, files = None, None
            with record_function("funcopt::zero/save_sharded/write"):
                try:
                    dcp = _dcp()
                    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                             process_group=group)
                    files = _own_files(tmp, target.rank)
                except _failures() as e:
                    error = _what(e)
                parts = _agree(group, error, what, files)
            error = None
            with record_function("funcopt::zero/save_sharded/publish"):
                if target.rank == 0:
                    try:
                        record = dict(target.describe(), format=target.format, save_id=save_id,
                                      dir=SAVE_PREFIX + save_id, world_size=target.world_size,
                                      files={k: v for part in parts for k, v in part.items()})
                        _publish(path, save_id, record)
                    except _failures() as e:
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
    rec, need = read_record_file(file)
    need(rec.get("format") in _FORMATS, f"format {rec.get('format')!r}, expected one of {sorted(_FORMATS)}")
    need(rec.get("dir") == SAVE_PREFIX + rec["save_id"], "dir does not name the save")
    _FORMATS[rec["format"]](rec, need)
    check_file_entries(rec.get("files"), _FILE, ".metadata", need)
    return rec


def _verify(path: str, rank: int, world: int) -> Tuple[Dict[str, Any], str]:
    """Check the record and the files it names: sizes everywhere, checksums split over ranks."""
    rec = read_record(path)
    save_dir = os.path.join(path, rec["dir"])
    if not os.path.isdir(save_dir):
        raise ValueError(f"the committed save {save_dir} is missing")
    # every rank checksums .metadata: it unpickles it next
    check_files(save_dir, os.listdir(save_dir), rec["files"], rank, world, also=(".metadata",))
    return rec, save_dir


def load_sharded(obj: Any, path: str, optimizer: Any = None) -> None:
    """Load the committed save at ``path`` (written by :func:`save_sharded` at any world size)
    into ``obj`` (and ``optimizer``, ZeRO-3 only).

    Only a complete, committed save is accepted: every file must match the
    commit record (size and checksum; each rank checksums a share of the files)
    and the checkpoint must be for the same kind of object and the same model
    (ZeRO-1/2: algorithm, parameter shapes and dtypes, group sizes; ZeRO-3:
    chunk names, sizes and dtypes, the parameters in them, buffers, and the
    optimizer's algorithm and groups when one is given).

    Args:
      obj: a ``ZeroRedundancyOptimizer`` or a ZeRO-3 root, as saved.
      path: the checkpoint directory.
      optimizer: ZeRO-3 only; default ``None`` (the model alone; a saved
        optimizer state is then ignored).

    Raises:
      DistributedError: on every rank, with the same message, if any rank
        found a problem; no rank has changed anything.

    .. warning:: collective: call on every rank of ``obj``'s process group.
    """
    target = _target(obj, optimizer)
    group = target.process_group
    what = f"load_sharded({path!r})"
    with record_function("funcopt::zero/load_sharded"):
        error, plan = None, None
        with record_function("funcopt::zero/load_sharded/verify"):
            try:
                rec, save_dir = _verify(path, target.rank, target.world_size)
                if rec["format"] != target.format:
                    raise ValueError(f"{path} holds a {_KIND[rec['format']]} checkpoint ({rec['format']}), "
                                     f"this is a {_KIND[target.format]} ({target.format})")
                target.match(rec)
                metadata = _dcp().FileSystemReader(save_dir).read_metadata()
                request, ctx = target.request(metadata, _sharder(group))
                if "funcopt.save_id" not in metadata.state_dict_metadata:
                    raise ValueError("the checkpoint lacks its save id")
                request["funcopt.save_id"] = None
                plan = (rec, save_dir, request, ctx)
            except _failures() as e:
                error = _what(e)
            _agree(group, error, what)
        assert plan is not None
        rec, save_dir, request, ctx = plan
        error, staged = None, None
        with record_function("funcopt::zero/load_sharded/read"):
            try:
                dcp = _dcp()
                dcp.load(request, storage_reader=dcp.FileSystemReader(save_dir), process_group=group,
                         planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
                if request.get("funcopt.save_id") != rec["save_id"]:
                    raise ValueError(f"{save_dir} holds save {request.get('funcopt.save_id')!r}, "
                                     f"the commit record names {rec['save_id']!r}")
                staged = target.stage(request, ctx)
            except _failures() as e:
                error = _what(e)
            _agree(group, error, what)
        target.commit(staged)


_KIND = {FORMAT: "ZeRO-1/2 optimizer", FORMAT3: "ZeRO-3 model"}


# ------------------------------------------------------- for other writers
class ShardedPart:
    """A ZeRO object's shards in one DCP directory, for a writer that publishes saves
    itself (:class:`funcopt.distributed.Checkpointer`): the same pieces and checks as
    :func:`save_sharded` / :func:`load_sharded`, without their commit record.

    ``write`` and ``read`` are collective and raise where they fail (DCP raises its
    failures on every rank); the caller agrees on errors and publishes.
    """

    def __init__(self, obj: Any, optimizer: Any = None):
        self.target = _target(obj, optimizer)
        self.format = self.target.format
        self.process_group = self.target.process_group

    def describe(self) -> Dict[str, Any]:
        """What a load must match (JSON-friendly)."""
        return dict(self.target.describe(), format=self.target.format)

    def write(self, directory: str, save_id: str) -> None:
        """Every rank writes its pieces under ``directory`` (one file per rank, synced)."""
        sd = self.target.save_dict(_sharder(self.process_group))
        if self.target.rank == 0:
            sd.setdefault("funcopt", {}).update(format=self.target.format, save_id=save_id)
        dcp = _dcp()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True),
                 process_group=self.process_group)

    def read(self, directory: str, described: Dict[str, Any], save_id: str) -> Any:
        """This rank's pieces from ``directory``, checked against ``described`` (what
        :meth:`describe` gave at save time) and staged; nothing is changed until :meth:`commit`."""
        if described.get("format") != self.target.format:
            raise ValueError(f"the checkpoint holds a {_KIND.get(described.get('format'), described.get('format'))} "
                             f"part, this is a {_KIND[self.target.format]}")
        self.target.match(described)
        dcp = _dcp()
        metadata = dcp.FileSystemReader(directory).read_metadata()
        request, ctx = self.target.request(metadata, _sharder(self.process_group))
        request["funcopt.save_id"] = None
        dcp.load(request, storage_reader=dcp.FileSystemReader(directory), process_group=self.process_group,
                 planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
        if request.get("funcopt.save_id") != save_id:
            raise ValueError(f"{directory} holds save {request.get('funcopt.save_id')!r}, expected {save_id!r}")
        return self.target.stage(request, ctx)

    def commit(self, staged: Any) -> None:
        """Apply what :meth:`read` staged.  Local."""
        self.target.commit(staged)


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

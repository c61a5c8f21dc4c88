"""Resumable training: :class:`Checkpointer` saves every N steps and resumes from the newest good save.

A training loop calls :meth:`Checkpointer.resume` once and :meth:`Checkpointer.step`
after every optimizer step.  Every ``every`` steps the model, the optimizer, the
LR scheduler, the GradScaler, every rank's RNG states, the step count and
``extra`` (the data position, ...) are written with ``torch.distributed.checkpoint``,
each rank its own pieces; on a restart (``torchrun --max-restarts``) ``resume``
loads the newest complete save, so the job continues where that save was taken,
bit for bit.

What is saved, by what the model and optimizer are:

* a :class:`~funcopt.distributed.ZeroRedundancyOptimizer` (ZeRO-1/2): its
  sharded state (:class:`~funcopt.distributed.zero.checkpoint.ShardedPart`,
  loadable at any world size) and the model's state dict (DDP or not);
* a ZeRO-3 root (``Zero3Sequential``, what ``zero3`` returns): its parameter
  chunks, buffers and the optimizer's state, sharded the same way;
* anything else -- FSDP2 (``fully_shard``), DDP, one process -- through torch's
  ``get_state_dict`` / ``set_state_dict`` (DTensors stay sharded; DCP reshards).

On disk, one directory per save::

    DIR/step-000000100/COMMIT.json     # the record: step, world size, every file's size and SHA-256
    DIR/step-000000100/sharded/...     # the ZeRO part (DCP files, one per rank)
    DIR/step-000000100/state/...       # the state_dict part (DCP files)
    DIR/step-000000100/train.pt        # step, scheduler, extra (rank 0)
    DIR/step-000000100/rank-<r>.pt     # rank r's RNG states and GradScaler

Atomicity: a save is written into ``DIR/.tmp-...``; when every rank has written
and checksummed its files, rank 0 writes the record into it and renames it to
``step-<N>`` -- the commit point.  Old saves beyond ``keep`` are renamed to
``.trash-...`` before they are removed.  A kill at any moment leaves only whole
``step-*`` directories; ``resume`` removes the leftovers, verifies the newest
save against its record (each rank checksums a share of the files) and, if it is
damaged, warns (:class:`CheckpointWarning`), moves it to ``rejected-step-<N>``
and takes the one before.  ``DIR`` must be one directory every rank sees (a
local disk for one machine, a shared file system across machines).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import uuid
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ._comm import DistributedError
from ._comm import agree_values as _agree
from ._files import (failures, check_file_entries, check_files, failure_text, fsync_dir, hash_file,
                     read_record_file)

FORMAT = "funcopt-checkpointer-v1"
RECORD = "COMMIT.json"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
REJECTED_PREFIX = "rejected-"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_FILE = re.compile(r"^((sharded|state)/(\.metadata|__\d+_\d+\.distcp)|train\.pt|rank-\d+\.pt)$")

# The moments a save passes through, in order (``on_phase`` sees each; "save-recorded" and
# "save-removing" only on rank 0, which alone commits and prunes; "save-removing" only
# when an old save or leftover is removed).
PHASES = ("save-begin", "save-written", "save-recorded", "save-committed", "save-removing")


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped (``resume`` took the one before)."""


# ----------------------------------------------------------------- helpers
def _world(group: Any) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(value: Any, group: Any) -> List[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what we mean."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _save_pt(obj: Any, file: str) -> None:
    with open(file, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _copies(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a copy (a DTensor stays a DTensor)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _load_pt(file: str) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def _check_loadable(file: str) -> None:
    """Raise now if ``resume`` could not load ``file`` back (``weights_only``): a value in
    ``extra`` (or the scheduler's state) that is not plain, e.g. a numpy scalar."""
    try:
        _load_pt(file)
    except Exception as e:
        why = [ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln] or [f"{type(e).__name__}: {e}"]
        raise TypeError(f"extra (or the scheduler's state) holds a value resume could not load; plain values only "
                        f"(numbers, strings, lists, dicts, tensors): {why[0][:300]}") from None


def read_record(save_dir: str) -> Dict[str, Any]:
    """The record of the save in ``save_dir``, checked for shape (``ValueError`` if bad).  Local."""
    file = os.path.join(save_dir, RECORD)
    if not os.path.isfile(file):
        raise ValueError(f"{save_dir} has no {RECORD}")
    rec, need = read_record_file(file)
    need(rec.get("format") == FORMAT, f"format {rec.get('format')!r}, expected {FORMAT!r}")
    need(isinstance(rec.get("step"), int) and rec["step"] >= 0, "bad step")
    need(rec.get("sharded") is None or isinstance(rec["sharded"], dict), "bad sharded")
    need(isinstance(rec.get("state"), bool), "bad state")
    check_file_entries(rec.get("files"), _FILE, "train.pt", need)
    return rec


def _listing(save_dir: str) -> List[str]:
    out = []
    for root, _, names in os.walk(save_dir):
        rel = os.path.relpath(root, save_dir)
        out += [name if rel == "." else f"{rel}/{name}" for name in names]
    return sorted(out)


def verify(save_dir: str, rank: int = 0, world: int = 1) -> Dict[str, Any]:
    """Check the save in ``save_dir`` against its record: every file present with its size,
    and the checksums of this rank's share (``rank::world``; offline: all).  Its record."""
    rec = read_record(save_dir)
    check_files(save_dir, [n for n in _listing(save_dir) if n != RECORD], rec["files"], rank, world)
    return rec


def saved_steps(directory: str) -> List[int]:
    """The steps of the committed saves in ``directory``, newest first (not verified).  Local."""
    if not os.path.isdir(directory):
        return []
    steps = [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(directory)) if m]
    return sorted(steps, reverse=True)


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"{STEP_PREFIX}{step:09d}")


# -------------------------------------------------------------------- class
class Checkpointer:
    """Save a training job every ``every`` steps; resume it from the newest good save.

    Once per step, after ``optimizer.step()`` (and ``scheduler.step()``), call
    :meth:`step`: it counts the step and, every ``every`` steps, saves (a
    collective).  At start, :meth:`resume` loads the newest complete save, if
    any, and returns its step: the loop continues from there.  Together with
    ``torchrun --max-restarts`` a job killed at any moment (between steps, in a
    step, in the middle of a save) resumes from the last committed save and
    ends bitwise where an uninterrupted run ends (same world size, deterministic
    data order keyed by the step or by ``extra``).

    Args:
      directory: where the saves go (created on the first save); one directory
        every rank sees.
      model: the module being trained: a plain module, DDP, FSDP2
        (``fully_shard``), or a ZeRO-3 root.
      optimizer: its optimizer: any funcopt or torch.optim optimizer, a
        :class:`~funcopt.distributed.ZeroRedundancyOptimizer`, or for a ZeRO-3
        root an optimizer over ``model.parameters()``; default ``None``.
      every: save every this many steps; default 100.
      keep: how many saves to keep (oldest removed after a new one is
        committed); default 2 (at least 1).
      scheduler: an LR scheduler (``state_dict``/``load_state_dict``); default ``None``.
      scaler: a ``torch.amp.GradScaler``; default ``None``.
      process_group: the ranks of the job; default: the ZeRO object's group, else
        the default group (no group at all: one process).
      on_phase: ``on_phase(phase, step)`` is called at each of :data:`PHASES` of a
        save, on every rank ("save-recorded" and "save-removing": on rank 0
        only) (tests and fault injection); default ``None``.

    Attributes:
      steps: steps counted so far (restored by :meth:`resume`).
      extra: a dict of plain values (numbers, strings, lists, dicts, tensors)
        saved with every checkpoint and restored by :meth:`resume`: the data
        position, an epoch, ...  (rank 0's copy is saved).

    Example:
      >>> import torch, funcopt, tempfile
      >>> from funcopt.distributed import Checkpointer
      >>> model = torch.nn.Linear(4, 1)
      >>> opt = funcopt.Adam(model.parameters(), lr=1e-2)
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), model, opt, every=2)
      >>> start = ckpt.resume()            # 0: nothing saved yet
      >>> for step in range(start, 5):
      ...     opt.zero_grad()
      ...     model(torch.ones(8, 4)).pow(2).mean().backward()
      ...     opt.step()
      ...     saved = ckpt.step()          # saves after steps 2 and 4
      >>> ckpt.saved_steps()
      [4, 2]

    .. warning:: :meth:`resume`, :meth:`step` and :meth:`save` are collective:
       call them on every rank.
    """

    def __init__(self, directory: str, model: Any, optimizer: Any = None, every: int = 100, keep: int = 2,
                 scheduler: Any = None, scaler: Any = None, process_group: Any = None,
                 on_phase: Optional[Callable[[str, int], None]] = None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"Checkpointer: every must be an int >= 1, got {every!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"Checkpointer: directory must be a path, got {type(directory).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Checkpointer: model must be an nn.Module, got {type(model).__name__}")
        for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None and not (callable(getattr(obj, "state_dict", None))
                                        and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"Checkpointer: {name} must have state_dict() and load_state_dict(), "
                                f"got {type(obj).__name__}")
        from .zero.checkpoint import ShardedPart
        from .zero.optimizer import ZeroRedundancyOptimizer

        self.directory = os.fspath(directory)
        self.model, self.optimizer = model, optimizer
        self.every, self.keep = every, keep
        self.scheduler, self.scaler, self.on_phase = scheduler, scaler, on_phase
        self.steps = 0
        self.extra: Dict[str, Any] = {}
        self._sharded: Any = None
        self._state_optimizer: Any = None  # the optimizer saved through get_state_dict (None: model only)
        if callable(getattr(model, "sharded_chunks", None)):  # a ZeRO-3 root: model and optimizer sharded
            self._sharded = ShardedPart(model, optimizer)
            self._with_state = False
        elif isinstance(optimizer, ZeroRedundancyOptimizer):
            self._sharded = ShardedPart(optimizer)
            self._with_state = True
        else:
            self._with_state = True
            self._state_optimizer = optimizer
        group = self._sharded.process_group if self._sharded is not None else None
        self.process_group = process_group if process_group is not None else group
        self.rank, self.world_size = _world(self.process_group)

    # ------------------------------------------------------------ queries
    def saved_steps(self) -> List[int]:
        """Steps of the committed saves on disk, newest first (not verified).  Local."""
        return saved_steps(self.directory)

    def _phase(self, phase: str, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, step)

    # --------------------------------------------------------------- parts
    def _state_dicts(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self._state_optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self._state_optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _train_state(self) -> Dict[str, Any]:
        return {"steps": self.steps, "extra": self.extra,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def _rank_state(self) -> Dict[str, Any]:
        return {"rng": _rng_state(), "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    # ---------------------------------------------------------------- save
    def step(self) -> bool:
        """Count one training step; save when the count is a multiple of ``every``.
        Whether it saved.  Collective."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self.save()
        return True

    def save(self) -> str:
        """Save now, as step :attr:`steps`; the committed directory.  Collective.

        Raises:
          DistributedError: on every rank, with the same message, if any rank
            failed (a full disk, permissions, any exception); the saves committed
            before are untouched and the next :meth:`resume` loads the newest of them.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        group, rank, step = self.process_group, self.rank, self.steps
        what = f"Checkpointer.save(step {step}) into {self.directory!r}"
        with record_function("funcopt::checkpointer/save"):
            error, save_id = None, None
            try:
                if rank == 0:
                    save_id = uuid.uuid4().hex
                    os.makedirs(self.directory, exist_ok=True)
                    tmp = os.path.join(self.directory, f"{TMP_PREFIX}{STEP_PREFIX}{step:09d}-{save_id}")
                    os.mkdir(tmp)
            except failures() as e:
                error = failure_text(e)
            save_id = _agree(group, error, what, save_id)[0]
            tmp = os.path.join(self.directory, f"{TMP_PREFIX}{STEP_PREFIX}{step:09d}-{save_id}")
            try:
                error, files = None, None
                with record_function("funcopt::checkpointer/save/write"):
                    try:
                        self._phase("save-begin", step)
                        if self._sharded is not None:
                            self._sharded.write(os.path.join(tmp, "sharded"), save_id)
                        if self._with_state:
                            with _one_process_quiet():
                                dcp.save(self._state_dicts(),
                                         storage_writer=FileSystemWriter(os.path.join(tmp, "state"),
                                                                         single_file_per_rank=True, sync_files=True),
                                         process_group=group)
                        _save_pt(self._rank_state(), os.path.join(tmp, f"rank-{rank}.pt"))
                        if rank == 0:
                            _save_pt(self._train_state(), os.path.join(tmp, "train.pt"))
                            _check_loadable(os.path.join(tmp, "train.pt"))
                        files = self._own_files(tmp)
                        self._phase("save-written", step)
                    except failures() as e:
                        error = failure_text(e)
                    parts = _agree(group, error, what, files)
                error = None
                with record_function("funcopt::checkpointer/save/commit"):
                    if rank == 0:
                        try:
                            self._commit(tmp, step, save_id, {k: v for part in parts for k, v in part.items()})
                        except failures() as e:
                            error = failure_text(e)
                    _agree(group, error, what)
            except DistributedError:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._phase("save-committed", step)
            error = None
            if rank == 0:
                try:
                    self._prune(step)
                except failures() as e:  # the new save is committed; an old one left over is removed later
                    warnings.warn(f"Checkpointer: could not remove old saves in {self.directory}: "
                                  f"{failure_text(e)}", CheckpointWarning, stacklevel=2)
            _agree(group, None, what)
        return _step_dir(self.directory, step)

    def _own_files(self, tmp: str) -> Dict[str, Dict[str, Any]]:
        """This rank's files in the save (relative path -> size and checksum), synced."""
        mine: Dict[str, Dict[str, Any]] = {}
        for name in _listing(tmp):
            base = name.rsplit("/", 1)[-1]
            if (base.startswith(f"__{self.rank}_") or name == f"rank-{self.rank}.pt"
                    or (self.rank == 0 and (base == ".metadata" or name == "train.pt"))):
                mine[name] = hash_file(os.path.join(tmp, name), sync=True)
        for sub in ("sharded", "state"):
            if os.path.isdir(os.path.join(tmp, sub)):
                fsync_dir(os.path.join(tmp, sub))
        return mine

    def _commit(self, tmp: str, step: int, save_id: str, files: Dict[str, Dict[str, Any]]) -> None:
        """Rank 0: write the record into the finished save and rename it into place."""
        listed = [n for n in _listing(tmp)]
        if listed != sorted(files):
            raise RuntimeError(f"files written {listed} differ from the files checksummed {sorted(files)}")
        record = {"format": FORMAT, "step": step, "save_id": save_id, "world_size": self.world_size,
                  "sharded": self._sharded.describe() if self._sharded is not None else None,
                  "state": self._with_state, "files": files}
        with open(os.path.join(tmp, RECORD), "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        self._phase("save-recorded", step)
        final = _step_dir(self.directory, step)
        if os.path.exists(final):  # a save of this step from before a resume further back: replaced
            os.rename(final, os.path.join(self.directory, f"{TRASH_PREFIX}{os.path.basename(final)}-{save_id}"))
        os.rename(tmp, final)  # the commit point
        fsync_dir(self.directory)

    def _prune(self, step: int) -> None:
        """Rank 0: move the saves beyond ``keep`` aside, then delete them and any trash."""
        for old in saved_steps(self.directory)[self.keep:]:
            src = _step_dir(self.directory, old)
            os.rename(src, os.path.join(self.directory, f"{TRASH_PREFIX}{os.path.basename(src)}-{uuid.uuid4().hex}"))
        fsync_dir(self.directory)
        self._clear_leftovers(step)

    def _clear_leftovers(self, step: int = -1) -> None:
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(TRASH_PREFIX) or (name.startswith(TMP_PREFIX) and step < 0):
                full = os.path.join(self.directory, name)
                files = _listing(full)
                if files and step >= 0:  # one file first, then the rest: a kill here is a half-removed save
                    os.remove(os.path.join(full, files[0]))
                    self._phase("save-removing", step)
                shutil.rmtree(full, ignore_errors=True)

    # -------------------------------------------------------------- resume
    def resume(self) -> int:
        """Load the newest complete save in ``directory``; its step (0: none, nothing loaded).

        Every rank checks the candidate against its record (a share of the
        checksums each); a damaged one (truncated, edited, unreadable) is moved to
        ``rejected-step-<N>`` with a :class:`CheckpointWarning`, and the one before is
        tried.  A save from another world size loads here (sharded parts are
        resharded; the RNG states of rank ``r`` come from rank ``r % W``).  Collective.

        Raises:
          DistributedError: on every rank, with the same message, if the save does
            not fit the model or optimizer (another model, another algorithm), or if
            saves exist but none is loadable; nothing was changed.
        """
        group, rank, world = self.process_group, self.rank, self.world_size
        what = f"Checkpointer.resume() from {self.directory!r}"
        with record_function("funcopt::checkpointer/resume"):
            error, steps = None, None
            try:
                if rank == 0 and os.path.isdir(self.directory):
                    self._clear_leftovers()
                steps = saved_steps(self.directory) if rank == 0 else None
            except failures() as e:
                error = failure_text(e)
            steps = _agree(group, error, what, steps)[0]
            rejected: List[str] = []
            for step in steps:
                save_dir = _step_dir(self.directory, step)
                error, rec = None, None
                try:
                    rec = verify(save_dir, rank, world)
                    if rec["step"] != step:
                        raise ValueError(f"{save_dir}: the record says step {rec['step']}")
                except failures() as e:
                    error = failure_text(e)
                errors = [e for e in _gather(error, group) if e is not None]
                if errors:
                    moved = os.path.join(self.directory, f"{REJECTED_PREFIX}{os.path.basename(save_dir)}")
                    warnings.warn(f"Checkpointer: the save {save_dir} is damaged ({errors[0]}); moved to {moved}; "
                                  f"resuming from the save before it", CheckpointWarning, stacklevel=2)
                    rejected.append(save_dir)
                    if rank == 0:
                        try:
                            shutil.rmtree(moved, ignore_errors=True)
                            os.rename(save_dir, moved)
                        except OSError:
                            pass
                    _agree(group, None, what)
                    continue
                self._load(save_dir, rec, what)
                return self.steps
            if rejected:
                raise DistributedError(f"{what}: no loadable save ({len(rejected)} damaged, moved aside); "
                                       f"remove the directory to start over")
            return 0

    def _load(self, save_dir: str, rec: Dict[str, Any], what: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        group, rank = self.process_group, self.rank
        error, staged = None, None
        with record_function("funcopt::checkpointer/resume/read"):
            try:
                if (rec["sharded"] is None) != (self._sharded is None) or rec["state"] != self._with_state:
                    raise ValueError(f"{save_dir} was saved from another kind of model/optimizer "
                                     f"(ZeRO part: {rec['sharded'] is not None}, state_dict part: {rec['state']})")
                sharded = (self._sharded.read(os.path.join(save_dir, "sharded"), rec["sharded"], rec["save_id"])
                           if self._sharded is not None else None)
                state = None
                if self._with_state:  # loaded into copies: a load that fails below changes nothing
                    state = _copies(self._state_dicts())
                    with _one_process_quiet():
                        dcp.load(state, storage_reader=FileSystemReader(os.path.join(save_dir, "state")),
                                 process_group=group)
                train = _load_pt(os.path.join(save_dir, "train.pt"))
                own = os.path.join(save_dir, f"rank-{rank % rec['world_size']}.pt")
                mine = _load_pt(own)
                if (train["scheduler"] is None) != (self.scheduler is None):
                    raise ValueError(f"{save_dir} was saved {'with' if train['scheduler'] is not None else 'without'} "
                                     f"an LR scheduler, this Checkpointer has {'one' if self.scheduler else 'none'}")
                if (mine["scaler"] is None) != (self.scaler is None):
                    raise ValueError(f"{save_dir} was saved {'with' if mine['scaler'] is not None else 'without'} "
                                     f"a GradScaler, this Checkpointer has {'one' if self.scaler else 'none'}")
                staged = (sharded, state, train, mine)
            except failures() as e:
                error = failure_text(e)
            _agree(group, error, what)
        assert staged is not None
        sharded, state, train, mine = staged
        error = None
        try:  # what remains can fail only on a model/optimizer mismatch the checks above let through
            if sharded is not None:
                self._sharded.commit(sharded)
            if state is not None:
                if self._state_optimizer is None:
                    set_model_state_dict(self.model, state["model"])
                else:
                    set_state_dict(self.model, self._state_optimizer, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(train["scheduler"])
            if self.scaler is not None:
                self.scaler.load_state_dict(mine["scaler"])
            _set_rng_state(mine["rng"])
            self.steps, self.extra = int(train["steps"]), dict(train["extra"])
        except failures() as e:
            error = failure_text(e)
        _agree(group, error, what)

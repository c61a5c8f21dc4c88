"""The few collectives the distributed layers use, in one place.

Every call goes through ``torch.distributed`` (gloo on CPU, NCCL on GPU); the
process group's own timeout bounds every wait, so a rank that never arrives
ends in an error, not a hang.  ``agree`` turns a local failure on any rank into
the same error on every rank.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class DistributedError(RuntimeError):
    """A check failed on some rank; raised on every rank."""


class DistributedValueError(DistributedError, ValueError):
    """A :class:`DistributedError` whose every rank failed with a ``ValueError``
    (e.g. a refused hyperparameter in a load): catchable as either."""


class DistributedTypeError(DistributedError, TypeError):
    """A :class:`DistributedError` whose every rank failed with a ``TypeError``."""


def rank_and_size(group: Optional[Any]) -> tuple:
    return dist.get_rank(group), dist.get_world_size(group)


def comm_device(group: Optional[Any]) -> torch.device:
    """Where collective buffers live: CUDA for NCCL, CPU otherwise."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def digest(obj: Any) -> int:
    """A stable 63-bit fingerprint of a picklable description."""
    h = hashlib.sha256(pickle.dumps(obj, protocol=4)).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def agree(error: Optional[str], group: Optional[Any], what: str, typed: bool = False) -> None:
    """Collective: raise ``DistributedError`` on every rank if any rank has an error.

    Call on every rank.  ``error`` is this rank's problem (``None`` when fine).
    With ``typed``, ``error`` reads ``"ValueError: ..."`` (``"TypeError: ..."``)
    where it is one, and when every failing rank's error is a ``ValueError``
    (``TypeError``) the error raised is also one (:class:`DistributedValueError`,
    :class:`DistributedTypeError`).
    """
    rank, world = rank_and_size(group)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return
    errors: List[Optional[str]] = [None] * world
    dist.all_gather_object(errors, error, group=group)
    msgs = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    # every failing rank's error a ValueError (TypeError), as "ValueError: ...": catchable as one
    kinds = {str(e).split(":", 1)[0] for e in errors if e is not None}
    cls = {"ValueError": DistributedValueError, "TypeError": DistributedTypeError}.get(
        kinds.pop() if typed and len(kinds) == 1 else "", DistributedError)
    raise cls(f"{what} failed on {len(msgs)} of {world} ranks: " + "; ".join(msgs))


def check_same(value: Any, group: Optional[Any], what: str) -> None:
    """Collective: every rank must pass an equal ``value`` (compared by digest).

    One all-gather of 8-byte digests; only when they differ, the values
    themselves are gathered so that the error names what differs (e.g.
    ``hyperparameters[0]['lr']: rank 0 has 0.01, rank 1 has 0.02``).  Raises
    ``DistributedError`` on every rank.  Call on every rank.
    """
    rank, world = rank_and_size(group)
    mine = torch.tensor([digest(value)], dtype=torch.int64, device=comm_device(group))
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    codes = [int(t.item()) for t in everyone]
    if len(set(codes)) != 1:
        differ = [r for r, c in enumerate(codes) if c != codes[0]]
        values = all_gather_object(value, group)
        details = [f"{d} (rank {r})" for r in differ for d in difference(values[0], values[r], "", r)[:3]]
        raise DistributedError(
            f"{what} differs across ranks (ranks {differ} disagree with rank 0"
            + (": " + "; ".join(details) if details else "") + "); "
            "every rank must construct it with the same parameters and hyperparameters, in the same order"
        )


def difference(a: Any, b: Any, path: str, rank: int) -> List[str]:
    """Where two descriptions (nested dicts, lists, tuples, scalars) differ, as
    ``path: rank 0 has A, rank R has B`` lines."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: List[str] = []
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                where = 0 if k in a else rank
                out.append(f"{path}[{k!r}]: only rank {where} has it")
            else:
                out.extend(difference(a[k], b[k], f"{path}[{k!r}]", rank))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{path or 'value'}: rank 0 has {len(a)} entries, rank {rank} has {len(b)}"]
        return [d for j, (x, y) in enumerate(zip(a, b)) for d in difference(x, y, f"{path}[{j}]", rank)]
    if digest(a) != digest(b):
        return [f"{path or 'value'}: rank 0 has {a!r}, rank {rank} has {b!r}"]
    return []


class Pending:
    """An issued reduce-scatter; ``wait()`` completes it (``output`` is valid after)."""

    def __init__(self, works: List[Any], finish: Optional[Callable[[], None]] = None):
        self.works = works
        self.finish = finish

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def reduce_scatter(output: Tensor, inputs: Sequence[Tensor], group: Optional[Any], owned: bool = False,
                   async_op: bool = False) -> Optional[Pending]:
    """``output <- sum over ranks of inputs[my rank]``.

    NCCL (and other backends): one ``reduce_scatter_tensor``.  gloo runs that as
    a full all-reduce; one ``reduce`` to each owner, all in flight at once, moved
    the same bytes ~3x faster on loopback, so gloo gets that.  ``owned=True``
    lets the reduces work in ``inputs`` (the caller's buffers, e.g. a bucket's:
    leave them alone until it completes).  ``async_op=True`` returns a
    :class:`Pending` to ``wait()`` on instead of waiting here.
    """
    rank, world = rank_and_size(group)
    if dist.get_backend(group) == "gloo":
        bufs = list(inputs) if owned else [t.clone() for t in inputs]
        works = [dist.reduce(bufs[r], dst=r if group is None else dist.get_global_rank(group, r),
                             group=group, async_op=True) for r in range(world)]
        pending = Pending(works, lambda: output.copy_(bufs[rank].view_as(output)))
    else:
        flat = torch.cat([t.reshape(-1) for t in inputs])
        pending = Pending([dist.reduce_scatter_tensor(output.view(-1), flat, group=group, async_op=True)])
    if async_op:
        return pending
    pending.wait()
    return None


def send_object(obj: Any, dst: int, group: Optional[Any]) -> None:
    dist.send_object_list([obj], group=group, group_dst=dst)


def recv_object(src: int, group: Optional[Any]) -> Any:
    box: List[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=src)
    return box[0]


def all_sum(t: Tensor, group: Optional[Any] = None) -> Tensor:
    """Collective: ``t`` (a small CPU vector: a two-phase rule's partial sums, e.g.
    Prodigy's) summed over the ranks of ``group``; returned on ``t``'s device and dtype."""
    buf = t.to(comm_device(group), copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.to(t.device, t.dtype)


def group_state_back(src: Any, dst_groups: List[dict]) -> None:
    """Copy a funcopt optimizer's per-group values (its class's ``group_state``: step
    counters, Prodigy's ``d``, Schedule-Free's ``train_mode``...) from ``src.param_groups``
    to ``dst_groups`` (a distributed layer's own groups, which the user and its
    state_dict see)."""
    names = [name for name, _ in getattr(type(src), "group_state", ())]
    if not names:
        return
    for a, b in zip(src.param_groups, dst_groups):
        for name in names:
            if name in a:
                b[name] = a[name]


def all_gather_object(obj: Any, group: Optional[Any]) -> List[Any]:
    _, world = rank_and_size(group)
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def agree_values(group: Optional[Any], error: Optional[str], what: str, value: Any = None) -> List[Any]:
    """Collective: every rank's ``value``; ``DistributedError`` on every rank, with the same
    message, if any rank has an ``error``.  Call on every rank.  Without a process group: one
    process, ``[value]``."""
    if dist.is_available() and dist.is_initialized():
        got = all_gather_object((error, value), group)
    else:
        got = [(error, value)]
    bad = [f"rank {r}: {e}" for r, (e, _) in enumerate(got) if e is not None]
    if bad:
        raise DistributedError(f"{what} failed on {len(bad)} of {len(got)} ranks: " + "; ".join(bad))
    return [v for _, v in got]

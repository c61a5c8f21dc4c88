"""What the ranks of tests/distributed/test_zero_checkpoint.py run.

One spawn of 4 ranks does everything: a "world of size k" is the process
group of ranks [0, k) (``dist.new_group``), passed to DDP and to
``ZeroRedundancyOptimizer(process_group=...)``; ranks outside it wait at a
barrier.  So a checkpoint saved by 4 ranks is loaded by a 2-rank and a 1-rank
optimizer in the same run, without paying for five process start-ups.
"""
from __future__ import annotations

import copy
import os
import shutil
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from funcopt.distributed import ZeroRedundancyOptimizer
from funcopt.distributed.checkpoint import shard_name
from funcopt.registry import REGISTRY

import _dist_zero_work as Z
from _dist_harness import Net, run_cases, snapshot

SAVE_AT, TOTAL = 4, 7  # steps before the checkpoint, steps in all

TRANSITIONS: List[Dict[str, Any]] = [
    dict(name="4to2", algo="Adam", save=4, load=2),
    dict(name="4to1", algo="Adam", save=4, load=1),
    dict(name="1to4", algo="Adam", save=1, load=4),
    dict(name="2to4", algo="Adam", save=2, load=4),
    dict(name="4to4", algo="Adam", save=4, load=4),
    dict(name="mixed-2to4-adamw", algo="AdamW", save=2, load=4, model=dict(mixed=True)),
    dict(name="adagrad-4to2", algo="Adagrad", save=4, load=2),
    # a greedy checkpoint loaded into a flat partition (whole parameters cut anew)
    dict(name="greedy4-to-flat2-sgd", algo="SGD", save=4, load=2, save_partition="greedy"),
    dict(name="flat1-to-greedy4-adam", algo="Adam", save=1, load=4, load_partition="greedy"),
    # saved by ZeRO-2 (no DDP), loaded by ZeRO-1 with DDP: the checkpoint does not depend on the stage
    dict(name="zero2-4to2", algo="Adam", save=4, load=2, save_stage=2),
]
for _t in TRANSITIONS:
    _t.setdefault("model", {})
    _t.setdefault("save_partition", "flat")
    _t.setdefault("load_partition", "flat")
    _t.setdefault("save_stage", 1)
    _t["kind"] = "transition"
    # the restricted-directory check needs the flat rule on both sides
    _t["restrict"] = _t["save_partition"] == _t["load_partition"] == "flat"


def case_of(t: Dict[str, Any], stage: int = 1, partition: str = "flat") -> Dict[str, Any]:
    return Z._case(t["name"], t["algo"], model=t["model"], stage=stage, partition=partition)


def flat_needed(numels: List[int], dtypes: List[torch.dtype], old_world: int, new_world: int, rank: int) -> Set[int]:
    """Old ranks whose flat ranges meet new rank ``rank``'s, computed from the flat rule alone."""
    needed = set()
    for dt in set(dtypes):
        total = sum(n for n, d in zip(numels, dtypes) if d == dt)
        po, pn = -(-total // old_world), -(-total // new_world)
        lo, hi = rank * pn, min((rank + 1) * pn, total)
        for r in range(old_world):
            a, b = r * po, min((r + 1) * po, total)
            if max(a, lo) < min(b, hi):
                needed.add(r)
    return needed


def _zero(case: Dict[str, Any], params: Any, group: Any, **hyper: Any) -> ZeroRedundancyOptimizer:
    spec = REGISTRY[case["algo"]]
    return ZeroRedundancyOptimizer(params, spec.torch_cls, process_group=group, partition=case["partition"],
                                   zero_stage=case["stage"], **(hyper or case["hyper"]))


def _train(case: Dict[str, Any], model: Net, opt: Any, steps: range, rank: int, world: int, group: Any) -> None:
    net = DDP(model, process_group=group) if case["stage"] == 1 else model
    Z.train(case, model, opt, steps, rank, world, net)


def _consolidated(opt: ZeroRedundancyOptimizer, rank: int) -> Optional[Dict[str, Any]]:
    opt.consolidate_state_dict(0)
    return copy.deepcopy(opt.state_dict()) if rank == 0 else None


class Worker:
    def __init__(self, rank: int, out_dir: str):
        self.rank, self.out = rank, out_dir
        # ranks [0, k) form the "world of size k"; new_group is collective over all ranks
        self.groups = {4: dist.group.WORLD, 2: dist.new_group([0, 1]), 1: dist.new_group([0])}

    def path(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    def save_phase(self, case: Dict[str, Any], world: int, ck: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.rank < world:
            g = self.groups[world]
            model = Net(**case["model"])
            opt = _zero(case, model.parameters(), g)
            _train(case, model, opt, range(0, SAVE_AT), self.rank, world, g)
            opt.save_sharded(ck)
            if self.rank == 0:
                torch.save(snapshot(model.parameters()), os.path.join(ck, "params.pt"))
                out["files"] = sorted(os.listdir(ck))
        dist.barrier()
        return out

    def transition(self, t: Dict[str, Any]) -> Dict[str, Any]:
        ck = self.path(f"ck-{t['name']}")
        out = self.save_phase(case_of(t, t["save_stage"], t["save_partition"]), t["save"], ck)
        if self.rank < t["load"]:
            case = case_of(t, 1, t["load_partition"])
            g = self.groups[t["load"]]
            model = Net(**case["model"])
            with torch.no_grad():
                for p, v in zip(model.parameters(), torch.load(os.path.join(ck, "params.pt"))):
                    p.copy_(v)
            src = ck
            if t["restrict"]:
                # this rank loads from a directory holding meta.pt and only the shards the flat rule
                # says it needs: reading any other shard fails the load ("missing shard")
                params = list(model.parameters())
                needed = flat_needed([p.numel() for p in params], [p.dtype for p in params],
                                     t["save"], t["load"], self.rank)
                src = self.path(f"view-{t['name']}-rank{self.rank}")
                os.makedirs(src)
                for f in ["meta.pt"] + [shard_name(r, t["save"]) for r in sorted(needed)]:
                    os.link(os.path.join(ck, f), os.path.join(src, f))
                out["needed"] = sorted(needed)
            # constructed with other hyperparameters: the checkpoint's must come back
            opt = _zero(case, model.parameters(), g, **dict(case["hyper"], lr=case["hyper"]["lr"] * 7))
            opt.load_sharded(src)
            out["lrs_after_load"] = [grp["lr"] for grp in opt.param_groups]
            _train(case, model, opt, range(SAVE_AT, TOTAL), self.rank, t["load"], g)
            sd = _consolidated(opt, self.rank)
            out["params"] = snapshot(model.parameters())
            if self.rank == 0:
                out["sd"] = sd
        dist.barrier()
        return out

    # ------------------------------------------------------------- corruptions
    def corrupt(self, case_: Dict[str, Any]) -> Dict[str, Any]:
        good = self.path("ck-4to4")  # Adam, flat, saved by 4 ranks (transition "4to4" ran before)
        other = self.path("ck-other-model")
        self.save_phase(Z._case("other", "Adam", model=dict(kind="other")), 4, other)
        bad: Dict[str, str] = {}
        if self.rank == 0:
            def copy_of(name: str) -> str:
                d = self.path(f"bad-{name}")
                shutil.copytree(good, d)
                bad[name] = d
                return d

            d = copy_of("truncated-shard")
            f = os.path.join(d, shard_name(2, 4))
            size = os.path.getsize(f)
            with open(f, "r+b") as fh:
                fh.truncate(size // 2)
            d = copy_of("garbage-shard")
            with open(os.path.join(d, shard_name(0, 4)), "wb") as fh:
                fh.write(os.urandom(1000))
            d = copy_of("missing-shard")
            os.remove(os.path.join(d, shard_name(3, 4)))
            bad["other-model"] = other
            d = copy_of("meta-of-other-model")
            shutil.copy(os.path.join(other, "meta.pt"), os.path.join(d, "meta.pt"))
            d = copy_of("shard-of-other-checkpoint")
            shutil.copy(os.path.join(other, shard_name(1, 4)), os.path.join(d, shard_name(1, 4)))
            d = copy_of("shard-of-other-world-size")  # same model, saved by 2 ranks, renamed
            shutil.copy(os.path.join(self.path("ck-2to4"), shard_name(1, 2)), os.path.join(d, shard_name(1, 4)))
            d = copy_of("bogus-meta")
            with open(os.path.join(d, "meta.pt"), "wb") as fh:
                fh.write(b"not a checkpoint at all" * 10)
            d = copy_of("foreign-meta")
            torch.save({"format": "someone-else-v3", "params": []}, os.path.join(d, "meta.pt"))
            bad["missing-dir"] = self.path("no-such-checkpoint")
        box = [bad]
        dist.broadcast_object_list(box, src=0)
        bad = box[0]

        results: Dict[str, Any] = {}
        for algo, steps, tried in [("Adam", 5, [k for k in bad]), ("SGD", 2, ["good-into-sgd"])]:
            c = Z._case("victim", algo, hyper=dict(Z.HYPER[algo][0], lr=Z.HYPER[algo][0]["lr"] * 2))
            model = Net()
            opt = _zero(c, model.parameters(), None)
            _train(c, model, opt, range(0, steps), self.rank, 4, None)
            before = dict(sd=_consolidated(opt, self.rank), lrs=[g["lr"] for g in opt.param_groups],
                          params=snapshot(model.parameters()))
            for name in tried:
                path = good if name == "good-into-sgd" else bad[name]
                results[name] = Z._catch(lambda: opt.load_sharded(path))
                results[name]["unchanged"] = dict(
                    sd=_consolidated(opt, self.rank), lrs=[g["lr"] for g in opt.param_groups],
                    params=snapshot(model.parameters()))
                results[name]["before"] = before
        return results


def worker(rank: int, world: int, out_dir: str) -> None:
    assert world == 4
    w = Worker(rank, out_dir)
    cases = list(TRANSITIONS) + [dict(kind="corrupt", name="corrupt")]
    run_cases(rank, out_dir, cases, lambda c: w.transition(c) if c["kind"] == "transition" else w.corrupt(c))

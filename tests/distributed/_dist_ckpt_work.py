"""What the ranks of tests/distributed/test_zero_checkpoint.py run.

One spawn of 4 ranks does everything: a "world of size k" is the process
group of ranks [0, k) (``dist.new_group``), passed to DDP and to
``ZeroRedundancyOptimizer(process_group=...)``; ranks outside it wait at a
barrier.  So a checkpoint saved by 4 ranks is loaded by a 2-rank and a 1-rank
optimizer in the same run, without paying for five process start-ups.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import math
import os
import shutil
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from funcopt.distributed import ZeroRedundancyOptimizer
from funcopt.distributed.checkpoint import COMMIT
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
    # a zero-element parameter (its state: empty tensors and a step)
    dict(name="empty-param-4to2", algo="Adam", save=4, load=2, model=dict(empty=True)),
    # a whole-parameter rule (greedy placement): Adafactor's factored rows/columns are saved
    # in their own shape by each parameter's owner and read whole by its new owner
    dict(name="adafactor-greedy-4to2", algo="Adafactor", save=4, load=2, save_partition="greedy",
         load_partition="greedy"),
    dict(name="adafactor-greedy-1to4", algo="Adafactor", save=1, load=4, save_partition="greedy",
         load_partition="greedy"),
]
for _t in TRANSITIONS:
    _t.setdefault("model", {})
    _t.setdefault("save_partition", "flat")
    _t.setdefault("load_partition", "flat")
    _t.setdefault("save_stage", 1)
    _t["kind"] = "transition"


def case_of(t: Dict[str, Any], stage: int = 1, partition: str = "flat") -> Dict[str, Any]:
    return Z._case(t["name"], t["algo"], model=t["model"], stage=stage, partition=partition)


@contextlib.contextmanager
def counting_reads(box: Dict[str, Any]) -> Iterator[None]:
    """Count the tensor elements (and the files) DCP reads in this process."""
    orig = FileSystemReader.read_data

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                box["elements"] += math.prod(item.lengths)
                box["files"].add(self.storage_data[item.storage_index].relative_path)
        return orig(self, plan, planner)

    FileSystemReader.read_data = read_data
    try:
        yield
    finally:
        FileSystemReader.read_data = orig


def save_dir(ck: str) -> str:
    """The directory the commit record of checkpoint ``ck`` names."""
    with open(os.path.join(ck, COMMIT)) as fh:
        return os.path.join(ck, json.load(fh)["dir"])


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

    def save_phase(self, case: Dict[str, Any], world: int, ck: str, steps: int = SAVE_AT) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.rank < world:
            g = self.groups[world]
            model = Net(**case["model"])
            opt = _zero(case, model.parameters(), g)
            _train(case, model, opt, range(0, steps), self.rank, world, g)
            opt.save_sharded(ck)
            sd = _consolidated(opt, self.rank)
            if self.rank == 0:
                torch.save(snapshot(model.parameters()), os.path.join(ck, "params.pt"))
                out["files"] = sorted(os.listdir(ck))
                out["save_files"] = sorted(os.listdir(save_dir(ck)))
                out["saved_sd"] = sd
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
            # constructed with other hyperparameters: the checkpoint's must come back
            opt = _zero(case, model.parameters(), g, **dict(case["hyper"], lr=case["hyper"]["lr"] * 7))
            reads: Dict[str, Any] = dict(elements=0, files=set())
            with counting_reads(reads):
                opt.load_sharded(ck)
            out["read_elements"], out["read_files"] = reads["elements"], sorted(reads["files"])
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
        again = self.path("ck-same-model-other-save")  # the 4to4 model and world, one step less
        self.save_phase(case_of(next(t for t in TRANSITIONS if t["name"] == "4to4")), 4, again, SAVE_AT - 1)
        bad: Dict[str, str] = {}
        if self.rank == 0:
            def copy_of(name: str) -> str:
                d = self.path(f"bad-{name}")
                shutil.copytree(good, d)
                bad[name] = d
                return d

            def file_of(d: str, name: str) -> str:
                return os.path.join(save_dir(d), name)

            def edit_record(d: str, **changes: Any) -> None:
                with open(os.path.join(d, COMMIT)) as fh:
                    rec = json.load(fh)
                rec.update(changes)
                with open(os.path.join(d, COMMIT), "w") as fh:
                    json.dump(rec, fh)

            d = copy_of("truncated-shard")
            f = file_of(d, "__2_0.distcp")
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
            d = copy_of("edited-piece")  # same size, a few bytes in the middle changed
            f = file_of(d, "__2_0.distcp")
            with open(f, "r+b") as fh:
                fh.seek(os.path.getsize(f) // 2)
                chunk = fh.read(8)
                fh.seek(os.path.getsize(f) // 2)
                fh.write(bytes(b ^ 0xFF for b in chunk))
            d = copy_of("edited-metadata")
            with open(file_of(d, ".metadata"), "r+b") as fh:
                fh.seek(40)
                fh.write(b"\x00\x01\x02")
            d = copy_of("garbage-shard")
            with open(file_of(d, "__0_0.distcp"), "wb") as fh:
                fh.write(os.urandom(1000))
            d = copy_of("missing-shard")
            os.remove(file_of(d, "__3_0.distcp"))
            d = copy_of("extra-file")
            shutil.copy(file_of(d, "__3_0.distcp"), file_of(d, "__7_0.distcp"))
            bad["other-model"] = other
            d = copy_of("shard-of-other-save")  # same model, world and file name; another save's content
            shutil.copy(file_of(again, "__1_0.distcp"), file_of(d, "__1_0.distcp"))
            d = copy_of("record-of-other-save")  # a commit record naming a save that is not there
            shutil.copy(os.path.join(again, COMMIT), os.path.join(d, COMMIT))
            d = copy_of("save-of-other-checkpoint")  # the other save's files under this save's name
            for f in glob.glob(os.path.join(save_dir(d), "*")) + glob.glob(os.path.join(save_dir(d), ".*")):
                os.remove(f)
            for f in os.listdir(save_dir(again)):
                shutil.copy(file_of(again, f), file_of(d, f))
            edit_record(d, files=json.load(open(os.path.join(again, COMMIT)))["files"])
            d = copy_of("forged-shard")  # garbage whose checksum a forger put in the record
            with open(file_of(d, "__1_0.distcp"), "wb") as fh:
                fh.write(os.urandom(3000))
            with open(os.path.join(d, COMMIT)) as fh:
                files = json.load(fh)["files"]
            from funcopt.distributed._files import hash_file as _hash
            files["__1_0.distcp"] = _hash(file_of(d, "__1_0.distcp"))
            edit_record(d, files=files)
            d = copy_of("bogus-record")
            with open(os.path.join(d, COMMIT), "wb") as fh:
                fh.write(b"not a checkpoint at all" * 10)
            d = copy_of("record-wrong-types")
            edit_record(d, files=["__0_0.distcp"])
            d = copy_of("record-escapes")
            edit_record(d, dir="../ck-4to4/" + json.load(open(os.path.join(good, COMMIT)))["dir"])
            d = copy_of("foreign-record")
            edit_record(d, format="someone-else-v3")
            d = copy_of("uncommitted")  # a save that was written but never committed
            os.rename(save_dir(d), os.path.join(d, ".tmp-save-" + "0" * 32))
            os.remove(os.path.join(d, COMMIT))
            d = self.path("bad-old-format")
            os.makedirs(d)
            torch.save({"format": "funcopt-zero-sharded-v1"}, os.path.join(d, "meta.pt"))
            bad["old-format"] = d
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

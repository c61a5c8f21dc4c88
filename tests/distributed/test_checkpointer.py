"""funcopt.distributed.Checkpointer: save every N steps, resume bitwise from the newest good save.

One process (no process group): a funcopt Adam with an LR scheduler and a GradScaler
saved every 2 steps, keep 2; a fresh job resumes the newest save and ends bitwise
where the uninterrupted run ends (parameters, optimizer state, LR, scaler, RNG,
``extra``); damaged saves (a flipped byte, a truncated file, no record) are
rejected with one warning each and the one before is loaded; leftovers of dead
saves are removed and never loaded; a full disk (``/dev/full``, ENOSPC from the
kernel) fails the save and keeps the one before; bad arguments and foreign saves
fail clearly and change nothing.

Spawned ranks (``_dist_checkpointer_work``): a 2-rank ZeRO-1 (DDP) job SIGKILLed
on one rank at each phase of a save, then a fresh 2-rank job resumes the save
before (or the new one, once committed) bitwise; ZeRO-2, ZeRO-3 and FSDP2 saved at
W=2 and resumed at W=1, W=4 (and W=3, rest tier) load exactly the saved full
state; a full disk on one rank fails the save with the same error on every rank.
torch.optim is the oracle for the numbers of the single-process run.
"""
from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import shutil
import signal
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import _dist_checkpointer_work as W  # noqa: E402
from _dist_harness import assert_tensors_close, case_result, load_all, spawn, tol  # noqa: E402

import funcopt  # noqa: E402
from funcopt.distributed import Checkpointer, CheckpointWarning, DistributedError  # noqa: E402
from funcopt.distributed.checkpointer import (PHASES, REJECTED_PREFIX, TMP_PREFIX, TRASH_PREFIX,  # noqa: E402
                                              read_record, saved_steps, verify)

SPAWN_DEADLINE = 120.0
pytestmark = [pytest.mark.timeout(int(2 * SPAWN_DEADLINE + 60)),
              # DCP's note when it saves without a process group (the single-process tests)
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


# ------------------------------------------------------------------ helpers
def assert_same(got: Any, want: Any, what: str) -> None:
    """Equal structure and values; tensors bitwise (same dtype and shape, ``torch.equal``)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__}, expected a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{what}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
        assert torch.equal(got, want), f"{what}: differs (max |diff| {(got.double() - want.double()).abs().max()})"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), \
            f"{what}: keys {list(got) if isinstance(got, dict) else type(got).__name__}, expected {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{what}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{what}: {got!r}, expected {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
    else:
        assert got == want, f"{what}: {got!r}, expected {want!r}"


def step_name(step: int) -> str:
    return f"step-{step:09d}"


@contextlib.contextmanager
def own_rng(seed: int):
    """This test's torch and Python RNG streams; the caller's are restored afterwards."""
    py = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(py)


def checkpoint_warnings(caught: List[warnings.WarningMessage]) -> List[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


# ===================================================== one process, no group
EVERY, TOTAL, STOP = 2, 7, 5  # saves after steps 2, 4, 6; the interrupted run stops after step 5


def sp_build(perturb: float = 0.0, torch_optim: bool = False, scheduler: bool = True) -> tuple:
    model = W.make_net("small", perturb)
    cls = torch.optim.Adam if torch_optim else funcopt.Adam
    opt = cls(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if scheduler else None
    # grows every 2 steps: its state differs from save to save
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    return model, opt, sched, scaler


def sp_step(model: Any, opt: Any, sched: Any, scaler: Any) -> None:
    """One step on data drawn from the global RNG (a resume must restore it) and a Python
    random coin for the loss weight (so must Python's RNG be)."""
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    weight = 1.0 + random.random()
    opt.zero_grad()
    scaler.scale(weight * torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    if sched is not None:
        sched.step()


def sp_state(model: Any, opt: Any, sched: Any, scaler: Any) -> Dict[str, Any]:
    return dict(params=[p.detach().clone() for p in model.parameters()], optim=copy.deepcopy(opt.state_dict()),
                lr=[g["lr"] for g in opt.param_groups], sched=sched.state_dict() if sched is not None else None,
                scaler=scaler.state_dict())


def sp_train(ck_dir: Any, steps: int, seed: int = 123, every: int = EVERY, keep: int = 2) -> Dict[Any, Any]:
    """From scratch, saving every ``every`` steps; the state after each save (with the RNG
    states and ``extra`` at that moment) and at the end."""
    out: Dict[Any, Any] = {}
    with own_rng(seed):
        model, opt, sched, scaler = sp_build()
        ck = Checkpointer(ck_dir, model, opt, every=every, keep=keep, scheduler=sched, scaler=scaler)
        assert ck.resume() == 0
        for step in range(steps):
            sp_step(model, opt, sched, scaler)
            ck.extra.update(pos=step + 1, seen=torch.arange(step + 1.0), tags={"epoch": step // 3, "name": "run"})
            if ck.step():
                out[ck.steps] = dict(sp_state(model, opt, sched, scaler), rng=torch.get_rng_state(),
                                     py=random.getstate(), extra=copy.deepcopy(ck.extra))
        out["final"] = sp_state(model, opt, sched, scaler)
    return out


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """The uninterrupted run (7 steps), and a pristine directory of an interrupted one
    (stopped after step 5: saves 2 and 4)."""
    root = tmp_path_factory.mktemp("checkpointer-sp")
    full = sp_train(root / "full", TOTAL)
    full["listing"] = sorted(os.listdir(root / "full"))
    cut = sp_train(root / "cut", STOP)
    return dict(root=root, full=full, cut=cut)


def fresh_copy(sp: Dict[str, Any], tmp_path: Any) -> str:
    dst = tmp_path / "ck"
    shutil.copytree(sp["root"] / "cut", dst)
    return str(dst)


def test_uninterrupted_run_keeps_two_saves_and_matches_torch_optim(sp):
    """keep=2 leaves exactly the two newest saves (and nothing else); the run itself is
    torch.optim's Adam with the same scheduler and scaler (the oracle)."""
    assert sp["full"]["listing"] == [step_name(4), step_name(6)]
    assert sorted(os.listdir(sp["root"] / "cut")) == [step_name(2), step_name(4)]
    with own_rng(123):
        model, opt, sched, scaler = sp_build(torch_optim=True)
        for _ in range(TOTAL):
            sp_step(model, opt, sched, scaler)
        want = sp_state(model, opt, sched, scaler)
    got = sp["full"]["final"]
    assert_tensors_close(got["params"], want["params"], "funcopt Adam vs torch.optim.Adam", **tol("Adam"))
    assert got["lr"] == want["lr"] and got["scaler"] == want["scaler"]


def test_resume_continues_bitwise(sp, tmp_path):
    """A fresh model (another starting point), optimizer, scheduler and scaler, another RNG
    seed: resume() returns 4 and restores everything of step 4 bitwise, RNG and extra
    included; training on to step 7 ends bitwise where the uninterrupted run ends."""
    ck_dir = fresh_copy(sp, tmp_path)
    at4 = sp["full"][4]
    with own_rng(999):
        model, opt, sched, scaler = sp_build(perturb=0.5)
        ck = Checkpointer(ck_dir, model, opt, every=EVERY, keep=2, scheduler=sched, scaler=scaler)
        assert ck.resume() == 4
        assert ck.steps == 4
        assert torch.equal(torch.get_rng_state(), at4["rng"]), "torch's RNG state was not restored"
        assert random.getstate() == at4["py"], "Python's RNG state was not restored"
        with torch.random.fork_rng(devices=[]):
            drawn = torch.rand(5)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(at4["rng"])
            assert torch.equal(drawn, torch.rand(5))
        assert_same(ck.extra, at4["extra"], "extra")
        state = sp_state(model, opt, sched, scaler)
        for key in ("params", "optim", "lr", "sched", "scaler"):
            assert_same(state[key], at4[key], f"resumed {key}")
        for _ in range(4, TOTAL):
            sp_step(model, opt, sched, scaler)
            ck.step()
        final = sp_state(model, opt, sched, scaler)
    for key in ("params", "optim", "lr", "sched", "scaler"):
        assert_same(final[key], sp["full"]["final"][key], f"final {key}")
    assert sorted(os.listdir(ck_dir)) == [step_name(4), step_name(6)]  # keep=2 after the resume too


def test_record_and_verify(sp):
    """Every file of a save is in its record (size, SHA-256); verify() checks them."""
    d = os.path.join(sp["root"], "cut", step_name(4))
    rec = verify(d)
    assert rec == read_record(d)
    assert rec["step"] == 4 and rec["world_size"] == 1 and rec["state"] is True and rec["sharded"] is None
    assert sorted(rec["files"]) == ["rank-0.pt", "state/.metadata", "state/__0_0.distcp", "train.pt"]
    assert saved_steps(os.path.join(sp["root"], "cut")) == [4, 2]


# ------------------------------------------------------------- damage
def _flip(file: str) -> None:
    with open(file, "r+b") as fh:
        fh.seek(os.path.getsize(file) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x01]))


def _truncate(file: str) -> None:
    with open(file, "r+b") as fh:
        fh.truncate(os.path.getsize(file) // 2)


DAMAGES = {
    "flipped-byte": ("state/__0_0.distcp", _flip),
    "truncated": ("state/__0_0.distcp", _truncate),
    "no-record": ("COMMIT.json", os.remove),
    "flipped-train-state": ("train.pt", _flip),
}


def _resume_fresh(ck_dir: str, **kw: Any) -> tuple:
    """A fresh job's resume in ``ck_dir``: (step or the exception, CheckpointWarnings, state)."""
    with own_rng(999), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, sched, scaler = sp_build(perturb=0.5)
        ck = Checkpointer(ck_dir, model, opt, every=EVERY, scheduler=sched, scaler=scaler, **kw)
        try:
            got: Any = ck.resume()
        except DistributedError as e:
            got = e
        return got, checkpoint_warnings(caught), sp_state(model, opt, sched, scaler), ck


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_newest_save_falls_back_to_the_one_before(sp, tmp_path, damage):
    """The newest save damaged: one CheckpointWarning naming it, it moves to
    rejected-step-..., and the save before is loaded bitwise."""
    ck_dir = fresh_copy(sp, tmp_path)
    name, how = DAMAGES[damage]
    newest = os.path.join(ck_dir, step_name(4))
    how(os.path.join(newest, name))
    got, warned, state, ck = _resume_fresh(ck_dir)
    assert got == 2, got
    assert len(warned) == 1 and newest in warned[0], warned
    assert sorted(os.listdir(ck_dir)) == [REJECTED_PREFIX + step_name(4), step_name(2)]
    for key in ("params", "optim", "lr", "sched", "scaler"):
        assert_same(state[key], sp["cut"][2][key], f"{damage}: {key}")
    assert_same(ck.extra, sp["cut"][2]["extra"], "extra")


def test_every_save_damaged_raises_and_changes_nothing(sp, tmp_path):
    """No loadable save: DistributedError; the model, the optimizer (stepped once, so it
    has state), the LR and the step count are what they were."""
    ck_dir = fresh_copy(sp, tmp_path)
    _flip(os.path.join(ck_dir, step_name(4), "state", "__0_0.distcp"))
    _truncate(os.path.join(ck_dir, step_name(2), "rank-0.pt"))
    with own_rng(5), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, sched, scaler = sp_build(perturb=0.5)
        sp_step(model, opt, sched, scaler)
        before = sp_state(model, opt, sched, scaler)
        ck = Checkpointer(ck_dir, model, opt, every=EVERY, scheduler=sched, scaler=scaler)
        with pytest.raises(DistributedError, match="no loadable save"):
            ck.resume()
        after = sp_state(model, opt, sched, scaler)
    assert len(checkpoint_warnings(caught)) == 2
    assert_same(after, before, "after a failed resume")
    assert ck.steps == 0 and ck.extra == {}
    assert sorted(os.listdir(ck_dir)) == [REJECTED_PREFIX + step_name(2), REJECTED_PREFIX + step_name(4)]


def test_leftovers_are_removed_and_never_loaded(sp, tmp_path):
    """A dead save's .tmp-* directory (here a complete copy of step 2 under a newer step's
    name) and a half-removed .trash-* one: resume removes both and loads step 4."""
    ck_dir = fresh_copy(sp, tmp_path)
    tmp = os.path.join(ck_dir, f"{TMP_PREFIX}{step_name(6)}-{'a' * 32}")
    trash = os.path.join(ck_dir, f"{TRASH_PREFIX}{step_name(8)}-{'b' * 32}")
    shutil.copytree(os.path.join(ck_dir, step_name(2)), tmp)
    shutil.copytree(os.path.join(ck_dir, step_name(2)), trash)
    os.remove(os.path.join(trash, "train.pt"))
    got, warned, state, ck = _resume_fresh(ck_dir)
    assert got == 4 and warned == []
    assert sorted(os.listdir(ck_dir)) == [step_name(2), step_name(4)]
    assert_same(state["params"], sp["cut"][4]["params"], "params")
    assert_same(state["optim"], sp["cut"][4]["optim"], "optimizer state")
    # leftovers alone: nothing to load, start from scratch, and they are gone
    only = tmp_path / "only-leftovers"
    only.mkdir()
    shutil.copytree(os.path.join(ck_dir, step_name(2)), only / os.path.basename(tmp))
    got, warned, state, ck = _resume_fresh(str(only))
    assert got == 0 and warned == [] and os.listdir(only) == []


def test_full_disk_fails_the_save_and_keeps_the_one_before(sp, tmp_path):
    """The save of step 4 writes its data file into /dev/full (ENOSPC from the kernel):
    DistributedError naming it; the directory holds step 2 only (no .tmp-*), which a fresh
    job resumes bitwise; the next save (step 6) succeeds."""
    ck_dir = str(tmp_path / "ck")

    def on_phase(phase: str, step: int) -> None:
        if phase == "save-begin" and step == 4:
            [tmp] = [n for n in os.listdir(ck_dir) if n.startswith(TMP_PREFIX)]
            os.makedirs(os.path.join(ck_dir, tmp, "state"))
            os.symlink("/dev/full", os.path.join(ck_dir, tmp, "state", "__0_0.distcp"))

    with own_rng(123):
        model, opt, sched, scaler = sp_build()
        ck = Checkpointer(ck_dir, model, opt, every=EVERY, scheduler=sched, scaler=scaler, on_phase=on_phase)
        for _ in range(3):
            sp_step(model, opt, sched, scaler)
            ck.extra.update(pos=ck.steps + 1, seen=torch.arange(ck.steps + 1.0),
                            tags={"epoch": ck.steps // 3, "name": "run"})
            ck.step()
        sp_step(model, opt, sched, scaler)
        with pytest.raises(DistributedError, match=r"save\(step 4\).*No space left on device"):
            ck.step()
        assert sorted(os.listdir(ck_dir)) == [step_name(2)]
        got, warned, state, _ = _resume_fresh(ck_dir)
        assert got == 2 and warned == []
        assert_same(state["params"], sp["cut"][2]["params"], "params")
        for _ in range(2):
            sp_step(model, opt, sched, scaler)
            ck.step()
    assert sorted(os.listdir(ck_dir)) == [step_name(2), step_name(6)]
    verify(os.path.join(ck_dir, step_name(6)))


# ----------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, exc, match", [
    (dict(every=0), ValueError, "every must be an int >= 1"),
    (dict(every=2.0), ValueError, "every must be an int >= 1"),
    (dict(every=True), ValueError, "every must be an int >= 1"),
    (dict(keep=0), ValueError, "keep must be an int >= 1"),
    (dict(keep="2"), ValueError, "keep must be an int >= 1"),
    (dict(model=lambda x: x), TypeError, "model must be an nn.Module, got function"),
    (dict(scheduler=object()), TypeError, "scheduler must have state_dict"),
    (dict(scaler=[1]), TypeError, "scaler must have state_dict"),
    (dict(directory=3), TypeError, "directory must be a path"),
], ids=["every-0", "every-float", "every-bool", "keep-0", "keep-str", "model-function", "scheduler-object",
        "scaler-list", "directory-int"])
def test_bad_arguments_fail_at_construction(tmp_path, kw, exc, match):
    model = W.make_net("small")
    args = dict(directory=str(tmp_path / "ck"), model=model, optimizer=funcopt.Adam(model.parameters(), lr=0.1))
    args.update(kw)
    with pytest.raises(exc, match=match):
        Checkpointer(**args)
    assert not (tmp_path / "ck").exists()


def _trained(kind: str = "small", scheduler: bool = True) -> tuple:
    model = W.make_net(kind, 0.5)
    opt = funcopt.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if scheduler else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    with own_rng(3):
        x = torch.randn(8, model.n_in)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    return model, opt, sched, scaler


def test_extra_that_resume_could_not_load_fails_the_save(tmp_path):
    """A numpy scalar in ``extra`` pickles, but resume loads with weights_only and could never
    read it back: the save fails at once, naming the type; the save before stays the newest
    and resumes."""
    np = pytest.importorskip("numpy")
    ck_dir = str(tmp_path / "ck")
    with own_rng(123):
        model, opt, sched, scaler = sp_build()
        ck = Checkpointer(ck_dir, model, opt, every=1, scheduler=sched, scaler=scaler)
        sp_step(model, opt, sched, scaler)
        ck.extra["pos"] = 1
        assert ck.step()
        sp_step(model, opt, sched, scaler)
        ck.extra["pos"] = np.int64(2)
        with pytest.raises(DistributedError, match=r"save\(step 2\).*extra .*plain values only.*numpy"):
            ck.step()
    assert sorted(os.listdir(ck_dir)) == [step_name(1)]
    got, warned, _, ck2 = _resume_fresh(ck_dir)
    assert got == 1 and warned == [] and ck2.extra == {"pos": 1}


@pytest.mark.parametrize("mismatch", ["other-model", "no-scheduler"])
def test_foreign_save_raises_and_changes_nothing(sp, tmp_path, mismatch):
    """A save of another model (other shapes), or one saved with an LR scheduler resumed
    without one: DistributedError naming the problem; the model and optimizer are
    unchanged (the load stages everything before it changes anything)."""
    ck_dir = fresh_copy(sp, tmp_path)
    model, opt, sched, scaler = _trained("other" if mismatch == "other-model" else "small",
                                         scheduler=mismatch != "no-scheduler")
    before = sp_state(model, opt, sched, scaler)
    ck = Checkpointer(ck_dir, model, opt, every=EVERY, scheduler=sched, scaler=scaler)
    match = "Size mismatch" if mismatch == "other-model" else "saved with an LR scheduler"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DistributedError, match=match):
            ck.resume()
    assert checkpoint_warnings(caught) == []  # not "damaged": the saves stay where they are
    assert_same(sp_state(model, opt, sched, scaler), before, "after a failed resume")
    assert ck.steps == 0
    assert sorted(os.listdir(ck_dir)) == [step_name(2), step_name(4)]


# ========================================================= spawned ranks
_RUNS: Dict[Any, Any] = {}


def _job(key: Any, fn: Any, world: int, dist_tmp: Any, *args: Any) -> tuple:
    if key not in _RUNS:
        s = spawn(fn, world, dist_tmp / f"checkpointer-{'-'.join(map(str, key))}", *args, deadline=SPAWN_DEADLINE)
        _RUNS[key] = (s, load_all(s))
    return _RUNS[key]


def _result(job: tuple, rank: int = 0) -> Any:
    spawned, results = job
    spawned.check()
    assert rank in results, spawned.report()
    return results[rank]


# ------------------------------------------------------------- kills
# (phase, killed rank, the step a fresh job resumes): "save-recorded" and "save-removing"
# happen on rank 0 only (it alone commits and prunes); the commit point is the rename
# between "save-recorded" and "save-committed".
KILLS = [
    ("save-begin", 0, 2), ("save-begin", 1, 2), ("save-written", 0, 2), ("save-written", 1, 2),
    ("save-recorded", 0, 2), ("save-committed", 0, 4), ("save-committed", 1, 4), ("save-removing", 0, 4),
]
# the default tier kills just before the commit point (test_chaos's default case kills in a save too);
# the rest tier at every other phase, after the commit point included
DEFAULT_KILLS = {("save-recorded", 0)}


@pytest.fixture(scope="module")
def reference(dist_tmp):
    """The uninterrupted 2-rank run (saving every 2 steps, keep 1): states after steps 2, 4, 6."""
    return _job(("reference",), W.reference, 2, dist_tmp, str(dist_tmp / "checkpointer-reference-ck"))


def test_phases_seen_by_each_rank(reference):
    """Every save passes through the phases in order: rank 0 sees all of them (it
    records, commits and, with keep=1, removes the save before), rank 1 the collective ones."""
    per_rank = {r: _result(reference, r)["phases"] for r in range(2)}
    for r, seen in per_rank.items():
        for step in (2, 4, 6):
            phases = [p for p, s in seen if s == step]
            if r == 0:
                want = list(PHASES) if step > 2 else [p for p in PHASES if p != "save-removing"]
            else:
                want = ["save-begin", "save-written", "save-committed"]
            assert phases == want, f"rank {r}, save {step}: {phases}"
    assert _result(reference)["listing"] == [step_name(6)]


@pytest.mark.parametrize("phase, victim, want", [
    k if (k[0], k[1]) in DEFAULT_KILLS else pytest.param(*k, marks=pytest.mark.rest) for k in KILLS],
    ids=[f"{p}-rank{v}" for p, v, _ in KILLS])
def test_sigkill_during_a_save_then_resume(dist_tmp, reference, phase, victim, want):
    """A 2-rank job commits the save of step 2; one rank SIGKILLs itself at ``phase`` of the
    save of step 4 (the job fails: the victim by the signal, the other rank at its next
    collective). A fresh 2-rank job resumes the save of step 2 (before the commit point)
    or of step 4 (after it), bitwise the uninterrupted run's state there, removes what the
    dead save left, and trains on to step 6 bitwise."""
    name = f"{phase}-rank{victim}"
    ck_dir = dist_tmp / f"checkpointer-kill-{name}-ck"
    killed = spawn(W.killed, 2, dist_tmp / f"checkpointer-kill-{name}", str(ck_dir), phase, victim,
                   deadline=SPAWN_DEADLINE, own=True)  # a rank dies: its own processes
    other = 1 - victim
    assert killed.exitcodes[victim] == -signal.SIGKILL, killed.report()
    # the other rank fails at its next collective (the gloo connection is gone): it raises, or
    # aborts while the dead group is torn down; either way by itself, long before the deadline
    assert killed.exitcodes[other] not in (0, None) and not killed.killed, killed.report()
    seen = torch.load(dist_tmp / f"checkpointer-kill-{name}" / f"phases-rank{victim}.pt", weights_only=False)
    assert seen[-1] == (phase, W.KILL_AT), seen
    left = sorted(os.listdir(ck_dir))
    if want == 2:  # the dead save is a .tmp-* directory beside step 2
        assert step_name(2) in left and any(n.startswith(f"{TMP_PREFIX}{step_name(4)}-") for n in left), left
    else:
        assert step_name(4) in left and not any(n.startswith(TMP_PREFIX) for n in left), left

    resumed = _job(("resume", name), W.resumed, 2, dist_tmp, str(ck_dir))
    ref = {r: _result(reference, r) for r in range(2)}
    for r in range(2):
        res = _result(resumed, r)
        assert res["before"] == left
        assert res["step"] == want
        assert res["warned"] == [], "a kill left a damaged step-* directory (the commit is not atomic)"
        assert [n for n in res["after"] if not n.startswith("step-")] == [], res["after"]
        assert saved_steps(str(ck_dir)) and max(saved_steps(str(ck_dir))) == W.TOTAL
        assert_same(res["loaded"]["params"], ref[r][want]["params"], f"rank {r}: resumed parameters")
        assert_same(res["final"]["params"], ref[r][W.TOTAL]["params"], f"rank {r}: parameters at step 6")
    res0 = _result(resumed)
    assert_same(res0["loaded"]["optim"], ref[0][want]["optim"], "resumed optimizer state (consolidated)")
    assert_same(res0["final"]["optim"], ref[0][W.TOTAL]["optim"], "optimizer state at step 6")
    assert res0["end"] == [step_name(W.TOTAL)]  # keep=1


# -------------------------------------------------- world size changes
def _ws(dist_tmp: Any, world: int) -> tuple:
    root = str(dist_tmp / "checkpointer-ws-ck")
    saved = _job(("ws-save",), W.ws_save, 2, dist_tmp, root)
    return saved, _job(("ws-resume", world), W.ws_resume, world, dist_tmp, root)


# W=1 in the default tier (the save's two ranks' pieces read by one); W=4 and W=3 in the rest tier
@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.rest), pytest.param(3, marks=pytest.mark.rest)])
@pytest.mark.parametrize("kind", W.WS_KINDS)
def test_resume_at_another_world_size(dist_tmp, kind, world):
    """Saved at W=2, resumed at W (fresh model from another starting point): the step, extra,
    the full model state and the full optimizer state (ZeRO-2: consolidated; ZeRO-3: every
    chunk's state put together; FSDP2: get_state_dict(full_state_dict=True)) are bitwise the
    saved ones; rank r's RNG state is saved rank r % 2's; where the batch splits evenly, two
    more steps match the W=2 run's (to float32 reduction-order rounding)."""
    saved, resumed = _ws(dist_tmp, world)
    s0 = case_result(saved[0], saved[1], kind, 0)
    assert s0["steps"] == [W.WS_SAVE]
    for r in range(world):
        res = case_result(resumed[0], resumed[1], kind, r)
        assert res["step"] == W.WS_SAVE and res["extra"] == {"kind": kind} and res["warned"] == []
        want_rng = case_result(saved[0], saved[1], kind, r % 2)["rng"]
        assert torch.equal(res["rng"], want_rng), f"rank {r}: RNG state is not saved rank {r % 2}'s"
    res0 = case_result(resumed[0], resumed[1], kind, 0)
    assert_same(res0["loaded"], s0["saved"], f"{kind} at W={world}: loaded full state")
    if "more" in res0:
        got, want = res0["more"]["model"], s0["more"]["model"]
        assert list(got) == list(want)
        assert_tensors_close([got[k] for k in want], [want[k] for k in want], f"{kind} at W={world}: 2 more steps",
                             **tol("Adam"))
    else:
        assert W.BATCH % world


# ------------------------------------------------------------ full disk
@pytest.fixture(scope="module")
def disk_full(dist_tmp):
    return _job(("disk-full",), W.disk_full, 2, dist_tmp, str(dist_tmp / "checkpointer-disk-full-ck"))


@pytest.mark.parametrize("kind", list(W.DISK_FULL_KINDS))
def test_full_disk_on_one_rank_fails_everywhere(disk_full, kind):
    """Rank 1's data file of the save of step 4 is /dev/full (ENOSPC): every rank raises the
    same DistributedError within seconds; no .tmp-* directory remains; step 2 is still the
    newest save and a fresh model resumes it bitwise."""
    spawned, results = disk_full
    res = [case_result(spawned, results, kind, r) for r in range(2)]
    for r in range(2):
        assert res[r]["error"] is not None, f"rank {r}: the save did not fail"
        assert re.search(r"save\(step 4\).*rank 1: OSError: \[Errno 28\] No space left on device", res[r]["error"]), \
            res[r]["error"]
        assert res[r]["seconds"] < 10, f"rank {r} took {res[r]['seconds']:.1f}s to fail"
        assert res[r]["after"] == [step_name(2)]
        assert res[r]["step"] == 2
    assert res[0]["error"] == res[1]["error"]
    assert_same(res[0]["loaded"], res[0]["at2"], f"{kind}: resumed state")
    if kind == "zero1":
        assert_same(res[1]["loaded"]["params"], res[1]["at2"]["params"], "rank 1: resumed parameters")

#!/usr/bin/env python
"""Chaos: sharded training jobs killed at random moments end bitwise where uninterrupted ones end.

For each configuration (``--configs``; ZeRO-1/2/3 and FSDP2 with Adam, ZeRO-1/2 and
FSDP2 with Adafactor) the script runs ``funcopt demo --zero S | --fsdp2`` under
``torchrun --standalone --nproc-per-node 2`` (2 local gloo processes, loopback only,
``--steps S``, a cosine LR schedule, a :class:`funcopt.distributed.Checkpointer` saving
every ``--every N`` steps and keeping ``--keep``):

* an uninterrupted run: the reference: its ``final state sha256`` (final unsharded
  parameters, optimizer state and learning rates) and its loss at every step;
* a chaos run under ``torchrun --max-restarts K+2`` with ``--kills K`` SIGKILLs:

  - ``K // 2`` planned (``--chaos-plan``): a rank kills itself at a moment drawn at
    random (``--seed``): a phase drawn without replacement from ``step-begin``,
    ``mid-step`` (after backward, before ``optimizer.step``), ``save-begin``,
    ``save-written``, ``save-recorded`` (rank 0: the record is written, the save is not
    renamed into place yet), ``save-committed``, ``save-removing`` (rank 0: an old save
    half removed), then a step where that phase happens and a rank where it can;
  - the rest external: the script sends SIGKILL to a random worker (a child of the
    torchrun process, found in /proc, its rank read from its environment) at a random
    wall-clock moment while the job trains: uniform over the next
    ``D = (S - resumed step) / (external kills left + 1)`` steps' time (at the
    uninterrupted run's pace, saves included) from the attempt's second step on, and at
    the latest once the attempt has logged D steps (the pace varies with the machine's
    load: every external kill must land while steps remain).  (An attempt's first two
    steps take seconds -- start-up, scripting -- and the rest milliseconds: a moment
    drawn over the whole attempt would nearly always fall in the warm-up.)  One external
    kill per attempt: the next waits for a new ``start`` event, and none is sent within
    two steps of a planned kill still to come (that attempt is left to the planned one);

  and checks, from the demo's events log (``--events``: rank 0 writes ``start``,
  ``step`` with the loss as a float hex, ``saved``, ``done``), the plan's marker files
  and the script's own kills: every kill fired, each attempt but the last ended by
  exactly one kill (so restarts = kills), the last attempt finished (exit code 0),
  the steps lost to each kill (the last step the killed attempt logged minus the step
  the next attempt resumed from) are at most N, the final digest is the reference's
  and every step's loss (the last value logged for it, and every replayed value too)
  is bitwise the reference's.

Scenarios (``--scenarios``, each on ``--scenario-configs``):

* ``first-save``: two kills in the very first save (``save-written`` on rank 1, then
  ``save-recorded`` on rank 0: nothing committed yet): both restarts start from step 0
  and the run still ends bitwise equal;
* ``full-disk``: a save fails for lack of space: where ``mount -t tmpfs`` works (root,
  a kernel that lets us) the checkpoint directory is a small tmpfs that the script
  fills with a filler file right after a save is committed (the next save hits a real
  ENOSPC on every rank's write path) and empties after the failure; elsewhere the
  plan's ``enospc`` action (one rank's DCP file a link to /dev/full).  The job exits
  1, torchrun restarts it, the save before the failed one is the one loaded, and the
  run ends bitwise equal.  The table says which of the two was used;
* ``resize``: the world size changes 2 -> 1 -> 2: a 2-process job (``--max-restarts
  0``) stopped by a planned kill at step a, a 1-process job resuming from the same
  directory stopped at step b, a 2-process job to the end.  Not bitwise (one process
  sums the gradients in another order than two): the losses are compared with an
  uninterrupted run at the world size that logged them (rank 0 logs its own slice's
  loss: a 2-process run logs half the batch, a 1-process run all of it), and the
  final loss (the full last batch, printed by the demo) with the uninterrupted
  2-process run's, both against ``--rtol``.  Its default, 1e-4 relative: the only
  difference is the rounding of the gradient sum (one mean over the batch against an
  all-reduce of two half-batch means, about 1e-7 relative per step in float32), carried
  through the steps after each change of world size; the demo itself accepts 1e-5
  between a whole 2-process run and one process, and 1e-4 leaves a factor 10 for the
  two changes (measured: about 1e-7).

Prints a markdown table (config, kills survived of K, restarts, max steps lost and N,
verdict, wall time) with the command line, torch version, commit and load average;
exits 1 if any verdict is FAILED.  Each torchrun job runs under ``--timeout`` seconds
(its process group is SIGKILLed past it).  All of a job's files (torchrun output,
events, plan, checkpoints) are in ``--workdir`` (default: a fresh directory under
/tmp, removed at the end unless something failed or ``--keep-files``).

    python benchmarks/chaos.py                              # everything (13-17 min on 2 cores)
    python benchmarks/chaos.py --configs zero2-adam --kills 4 --steps 30 --scenarios first-save
    python benchmarks/chaos.py --scenarios none --seed 3
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "zero1-adam": ["--zero", "1", "--optimizer", "adam"],
    "zero2-adam": ["--zero", "2", "--optimizer", "adam"],
    "zero3-adam": ["--zero", "3", "--optimizer", "adam"],
    "fsdp2-adam": ["--fsdp2", "--optimizer", "adam"],
    "zero1-adafactor": ["--zero", "1", "--optimizer", "adafactor"],
    "zero2-adafactor": ["--zero", "2", "--optimizer", "adafactor"],
    "fsdp2-adafactor": ["--fsdp2", "--optimizer", "adafactor"],
}
STEP_PHASES = ("step-begin", "mid-step")
SAVE_PHASES = ("save-begin", "save-written", "save-recorded", "save-committed", "save-removing")
RANK0_ONLY = ("save-recorded", "save-removing")
SCENARIOS = ("first-save", "full-disk", "resize")
NPROC = 2
POLL = 0.02  # seconds between looks at the events log

# The demo logs float(loss.item()): the float32 loss, widened.
# A worker that finished (its "done" event logged) and then died in the interpreter's shutdown:
# gloo's worker thread released the last collective's tensors (which takes the GIL) after
# finalization began, when something kept the process group alive past destroy_process_group.
# Not a checkpoint problem, but the job crashed: reported as its own kind of failure.
EXIT_ABORT = "terminate called without an active exception"
EXIT_ABORT_PROBLEM = "exit abort"
_DIGEST = re.compile(r"^final state sha256: ([0-9a-f]{64})$", re.M)
_FINAL_LOSS = re.compile(r"^final loss, (?!torch\.optim)[^:]*:\s+(\S+)$", re.M)


# --------------------------------------------------------------- processes
def env() -> Dict[str, str]:
    """The environment of every torchrun job: one thread, loopback only, not nested in another torchrun."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")}
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if os.path.isdir("/sys/class/net/lo"):  # gloo on the loopback interface (torchrun --standalone: localhost)
        e["GLOO_SOCKET_IFNAME"] = "lo"
    return e


def children(pid: int) -> List[int]:
    """Living (not zombie) child processes of ``pid``, from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(name))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (torchrun starts its workers in sessions of their own:
    killing its process group would leave them running)."""
    try:
        os.kill(pid, signal.SIGSTOP)  # no new worker while we collect them
    except ProcessLookupError:
        return
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def workers(torchrun_pid: int) -> Dict[int, int]:
    """rank -> pid of the worker processes torchrun started (its children with ``RANK`` set)."""
    out = {}
    for pid in children(torchrun_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env_vars = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env_vars:
            out[int(env_vars[b"RANK"])] = pid
    return out


class Job:
    """One torchrun job: its command, process, events log, plan markers and output."""

    def __init__(self, workdir: str, name: str, nproc: int, max_restarts: int, demo: List[str], timeout: float,
                 plan: Optional[List[Dict[str, Any]]] = None, ckpt_dir: Optional[str] = None):
        self.dir = os.path.join(workdir, name)
        for n in range(2, 1000):  # a job run again (a reference after a failure) keeps the first one's files
            if not os.path.exists(self.dir):
                break
            self.dir = os.path.join(workdir, f"{name}-{n}")
        os.makedirs(self.dir)
        self.nproc, self.timeout = nproc, timeout
        self.ckpt_dir = ckpt_dir or os.path.join(self.dir, "ck")
        self.events_path = os.path.join(self.dir, "events.jsonl")
        self.log_path = os.path.join(self.dir, "torchrun.log")
        self.plan = list(plan or [])
        self.plan_path = os.path.join(self.dir, "plan.json") if plan is not None else None
        if self.plan_path:
            with open(self.plan_path, "w") as fh:
                json.dump({"kills": self.plan}, fh)
        self.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    f"--max-restarts={max_restarts}", "-m", "funcopt", "demo", *demo,
                    "--checkpoint-dir", self.ckpt_dir, "--events", self.events_path]
        if self.plan_path:
            self.cmd += ["--chaos-plan", self.plan_path]
        self.events: List[Dict[str, Any]] = []  # each with "t": seconds since start, when the driver saw it
        self.bad_lines = 0
        self.fired: Dict[int, int] = {}  # plan index -> attempt index it fired in
        self._pos, self._buf = 0, b""
        self.rc: Optional[int] = None
        self.timed_out = False
        self.wall = 0.0

    # ------------------------------------------------------------ watching
    def now(self) -> float:
        return time.monotonic() - self.t0

    def poll(self) -> List[Dict[str, Any]]:
        """New events since the last call (and new plan markers, attributed to the current attempt)."""
        new: List[Dict[str, Any]] = []
        try:
            with open(self.events_path, "rb") as fh:
                fh.seek(self._pos)
                data = fh.read()
        except FileNotFoundError:
            data = b""
        self._pos += len(data)
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        t = self.now()
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut by a SIGKILL: never seen, but not trusted either
                self.bad_lines += 1
                continue
            ev["t"] = t
            new.append(ev)
        self.events += new
        for i in range(len(self.plan)):
            if i not in self.fired and os.path.exists(f"{self.plan_path}.fired-{i}"):
                self.fired[i] = len(self.starts()) - 1
        return new

    def starts(self) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["event"] == "start"]

    def attempt_events(self, start: Dict[str, Any]) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["pid"] == start["pid"]]

    # ------------------------------------------------------------- running
    def run(self, tick: Optional[Callable[["Job"], None]] = None) -> "Job":
        """Start the job and wait for it, calling ``tick(job)`` every ``POLL`` seconds."""
        self.t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT,
                                         start_new_session=True)
            try:
                while self.proc.poll() is None:
                    if self.now() > self.timeout:
                        self.timed_out = True
                        kill_tree(self.proc.pid)
                        self.proc.wait()
                        break
                    self.poll()
                    if tick is not None:
                        tick(self)
                    time.sleep(POLL)
            finally:
                if self.proc.poll() is None:  # an exception in tick, ^C, SIGTERM: do not leave the job behind
                    kill_tree(self.proc.pid)
                    self.proc.wait()
        self.rc = self.proc.returncode
        self.wall = self.now()
        self.poll()
        with open(os.path.join(self.dir, "timeline.json"), "w") as fh:  # what the driver saw, when
            json.dump({"cmd": self.cmd, "rc": self.rc, "wall": self.wall, "fired": self.fired,
                       "events": self.events}, fh, indent=0)
        return self

    def output(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    def digest(self) -> Optional[str]:
        found = _DIGEST.findall(self.output())
        return found[-1] if found else None

    def final_loss(self) -> Optional[float]:
        found = _FINAL_LOSS.findall(self.output())
        return float(found[-1]) if found else None

    def losses(self) -> Dict[int, str]:
        """step -> the last loss logged for it (float hex)."""
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step"}

    def exit_aborts(self) -> int:
        """Attempts that finished (logged "done") and still failed: followed by a restart, or the last one
        with a nonzero exit code.  (The survivors of a killed attempt may abort at exit too: not counted.)"""
        starts = self.starts()
        finished = [any(e["event"] == "done" for e in self.attempt_events(st)) for st in starts]
        n = sum(finished[:-1])
        if finished and finished[-1] and self.rc not in (0, None) and not self.timed_out:
            n += 1
        return n

    def problem_tail(self) -> str:
        lines = [ln for ln in self.output().splitlines() if ln.strip()]
        return " | ".join(lines[-3:])[-400:]


# ------------------------------------------------------------------ plans
def draw_plan(rng: random.Random, count: int, steps: int, every: int, keep: int) -> List[Dict[str, Any]]:
    """``count`` planned kills at distinct moments: phases drawn without replacement (then again)."""
    saves = list(range(every, steps + 1, every))
    phases: List[str] = []
    while len(phases) < count:
        pool = list(STEP_PHASES + SAVE_PHASES)
        if len(saves) <= keep:  # no save is ever removed
            pool.remove("save-removing")
        if not saves:
            pool = list(STEP_PHASES)
        phases += rng.sample(pool, len(pool))
    plan: List[Dict[str, Any]] = []
    taken = set()
    for phase in phases[:count]:
        for _ in range(1000):
            if phase in STEP_PHASES:
                step = rng.randrange(0, steps)
            elif phase == "save-removing":  # from the (keep+1)-th save on
                step = rng.choice(saves[keep:])
            else:
                step = rng.choice(saves)
            rank = 0 if phase in RANK0_ONLY else rng.randrange(NPROC)
            if (step, phase, rank) not in taken:
                break
        taken.add((step, phase, rank))
        plan.append({"rank": rank, "step": step, "phase": phase, "action": "kill"})
    # in the order they happen: the save of step k, then step k+1 (step-begin k, mid-step k)
    return sorted(plan, key=lambda k: (k["step"], (SAVE_PHASES + STEP_PHASES).index(k["phase"])))


def describe_plan_kill(k: Dict[str, Any]) -> str:
    action = "" if k.get("action", "kill") == "kill" else f" {k['action']}"
    return f"rank {k['rank']}{action} at {k['phase']} {k['step']}"


class ExternalKiller:
    """``tick`` for a chaos run: SIGKILL a random worker at a random moment, once per attempt."""

    def __init__(self, draws: List[Tuple[float, int]], per_step: float, steps: int):
        self.draws, self.per_step, self.steps = draws, per_step, steps
        self.kills: List[Dict[str, Any]] = []
        self.armed: Optional[Tuple[int, float, int]] = None  # (attempt, when, at the latest after this step)
        self.deferred = 0

    def __call__(self, job: Job) -> None:
        j = len(self.kills)
        if j == len(self.draws):
            return
        starts = job.starts()
        if not starts or any(e["event"] == "done" for e in job.events):
            return
        attempt = len(starts) - 1
        if any(k["attempt"] == attempt for k in self.kills) or attempt in job.fired.values():
            return  # this attempt already ends with a kill
        trained = [e for e in job.attempt_events(starts[-1]) if e["event"] == "step"]
        if len(trained) < 2:
            return  # not training at speed yet (loading, warming up), or resumed at the end
        u, rank = self.draws[j]
        last = trained[-1]["step"]
        if self.armed is None or self.armed[0] != attempt:
            start = starts[-1]["step"]
            span = max((self.steps - start) // (len(self.draws) - j + 1), 2)
            self.armed = (attempt, job.now() + u * max(self.per_step * span, 0.05),
                          min(start + span, self.steps - 1))
            return
        if job.now() < self.armed[1] and last < self.armed[2]:
            return
        if any(i not in job.fired and last - 1 <= k["step"] <= last + 2 for i, k in enumerate(job.plan)):
            self.armed = (attempt, float("inf"), self.steps + 1)  # a planned kill is about to end this attempt
            self.deferred += 1
            return
        pids = workers(job.proc.pid)
        if len(pids) != job.nproc or rank not in pids:
            return  # the attempt is ending (or starting): look again
        os.kill(pids[rank], signal.SIGKILL)
        self.kills.append({"attempt": attempt, "rank": rank, "pid": pids[rank], "after_step": last,
                           "t": round(job.now() - trained[1]["t"], 3)})


# ---------------------------------------------------------------- analysis
def attempts_of(job: Job, external: List[Dict[str, Any]], other: Dict[int, str]) -> List[Dict[str, Any]]:
    """Per attempt: its start step, world, the last step it logged, done or not, the faults that ended it
    (planned, external, ``other``: attempt -> what ended it)."""
    out = []
    for i, st in enumerate(job.starts()):
        evs = job.attempt_events(st)
        steps = [e["step"] for e in evs if e["event"] == "step"]
        faults = [("plan", describe_plan_kill(job.plan[p])) for p, a in sorted(job.fired.items()) if a == i]
        faults += [("external", f"rank {k['rank']} (pid {k['pid']}) after step {k['after_step']}")
                   for k in external if k["attempt"] == i]
        faults += [("other", other[i])] if i in other else []
        done = any(e["event"] == "done" for e in evs)
        if done and i < len(job.starts()) - 1 and not faults:
            faults.append(("exit-abort", "a worker aborted at exit after the job finished"))
        out.append(dict(start=st["step"], world=st["world"], last=max(steps) if steps else st["step"],
                        done=done, faults=faults))
    return out


def compare_losses(got: Job, ref: Job) -> List[str]:
    """Problems: a step missing, or a loss (last logged, or any replayed value) not bitwise the reference's."""
    want = ref.losses()
    problems = []
    last = got.losses()
    missing = sorted(set(want) - set(last))
    if missing:
        problems.append(f"steps never logged: {missing[:10]}")
    bad = [s for s in sorted(last) if s in want and last[s] != want[s]]
    if bad:
        s = bad[0]
        problems.append(f"loss differs at {len(bad)} steps (first: step {s}: {float.fromhex(last[s])!r} vs "
                        f"{float.fromhex(want[s])!r})")
    replays = [e for e in got.events if e["event"] == "step" and e["step"] in want and e["loss"] != want[e["step"]]]
    if replays and not bad:
        problems.append(f"{len(replays)} replayed losses differ from the reference (first: step {replays[0]['step']})")
    return problems


def check_run(job: Job, ref: Job, kills_expected: int, external: List[Dict[str, Any]], every: int,
              other: Optional[Dict[int, str]] = None) -> Dict[str, Any]:
    """The verdict of a run with restarts: every kill fired, each attempt but the last ended by one fault
    (a kill, or ``other``: attempt -> a fault the plan does not know of), few steps lost, bitwise equal."""
    atts = attempts_of(job, external, other or {})
    problems: List[str] = []
    if job.timed_out:
        problems.append(f"timed out after {job.timeout:.0f} s")
    elif job.rc != 0 and not (job.exit_aborts() and atts and atts[-1]["done"]):
        problems.append(f"torchrun exit code {job.rc}: {job.problem_tail()}")
    problems += exit_abort_problems(job)
    unfired = [describe_plan_kill(k) for i, k in enumerate(job.plan) if i not in job.fired]
    if unfired:
        problems.append(f"planned kills that never fired: {unfired}")
    fired = len(job.fired) + len(external)
    if fired != kills_expected:
        problems.append(f"{fired} kills fired, {kills_expected} planned")
    for i, a in enumerate(atts):
        if i < len(atts) - 1 and len(a["faults"]) != 1:
            problems.append(f"attempt {i} ended with {len(a['faults'])} faults (expected 1): {a['faults']}")
        if i == len(atts) - 1 and (a["faults"] or not a["done"]) and not job.timed_out:
            problems.append(f"the last attempt did not finish cleanly: {a['faults']}, done={a['done']}")
    lost = [atts[i]["last"] - atts[i + 1]["start"] for i in range(len(atts) - 1)]
    if any(x > every or x < 0 for x in lost):
        problems.append(f"steps lost per kill {lost}: not all in 0..{every}")
    if job.bad_lines:
        problems.append(f"{job.bad_lines} unreadable lines in the events log")
    if job.digest() is None or job.digest() != ref.digest():
        problems.append(f"final digest {job.digest()} != reference {ref.digest()}")
    problems += compare_losses(job, ref)
    # a kill survived: its attempt was followed by another, and the run finished
    survived = (sum(1 for a in atts[:-1] for kind, _ in a["faults"] if kind in ("plan", "external"))
                if atts and atts[-1]["done"] else 0)
    return dict(attempts=atts, restarts=len(atts) - 1, lost=lost, survived=survived, problems=problems)


def exit_abort_problems(job: Job, what: str = "") -> List[str]:
    n = job.exit_aborts()
    if not n:
        return []
    seen = EXIT_ABORT in job.output()
    return [f"{EXIT_ABORT_PROBLEM}: {what or 'the job'} finished (\"done\" logged) {n} time(s) and still failed"
            + (f" ('{EXIT_ABORT}' in the output: SIGABRT in the interpreter's shutdown; torch's gloo worker "
               f"thread freed a collective's tensors after finalization began)" if seen else
               f": {job.problem_tail()}")
            + ("; torchrun restarted it" if job.rc == 0 else "")]


def verdict(problems: List[str], ok: str) -> str:
    if not problems:
        return ok
    if all(p.startswith(EXIT_ABORT_PROBLEM) for p in problems):
        return f"FAILED ({EXIT_ABORT_PROBLEM}; otherwise {ok})"
    return "FAILED"


# --------------------------------------------------------------- the runs
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rows: List[Dict[str, Any]] = []
        self.refs: Dict[Tuple[str, int], Job] = {}
        self.ref_problems: Dict[Tuple[str, int], List[str]] = {}
        self.failed = False

    def demo(self, cfg: str) -> List[str]:
        a = self.args
        return [*CONFIGS[cfg], "--steps", str(a.steps), "--checkpoint-every", str(a.every), "--checkpoint-keep",
                str(a.keep), "--lr-schedule", a.lr_schedule, "--seed", str(a.seed), "--batch-size",
                str(a.batch_size), "--threads", "1", "--no-progress"]

    def job(self, cfg: str, name: str, nproc: int = NPROC, restarts: int = 0, **kw: Any) -> Job:
        return Job(self.args.workdir, f"{cfg}/{name}", nproc, restarts, self.demo(cfg), self.args.timeout, **kw)

    def reference(self, cfg: str, nproc: int = NPROC) -> Job:
        key = (cfg, nproc)
        if key not in self.refs:
            ref = self.job(cfg, f"reference-w{nproc}", nproc).run()
            steps = sorted(ref.losses())
            finished = any(e["event"] == "done" for e in ref.events)
            # a worker that aborted at exit after "done" leaves a usable reference (and a reported problem)
            ok = ((ref.rc == 0 or (finished and ref.exit_aborts())) and ref.digest() is not None
                  and steps == list(range(1, self.args.steps + 1)))
            self.ref_problems[key] = exit_abort_problems(ref, f"the uninterrupted run at {nproc} process(es)")
            say(f"  {cfg}: uninterrupted run at {nproc} process(es): {ref.wall:.1f} s, exit {ref.rc}, "
                f"digest {(ref.digest() or '-')[:16]}..., final loss {ref.final_loss()!r}")
            if not ok:
                if ref.timed_out:
                    raise RuntimeError(f"{cfg}: the uninterrupted run timed out after {ref.timeout:.0f} s "
                                       f"(output in {ref.log_path})")
                raise RuntimeError(f"{cfg}: the uninterrupted run failed (exit {ref.rc}): {ref.problem_tail()} "
                                   f"(output in {ref.log_path})")
            self.refs[key] = ref
        return self.refs[key]

    def row(self, cfg: str, what: str, kills: str, restarts: Any, lost: str, verdict: str, wall: float,
            problems: List[str]) -> None:
        self.rows.append(dict(config=cfg, what=what, kills=kills, restarts=restarts, lost=lost, verdict=verdict,
                              wall=wall, problems=problems))
        if verdict.startswith("FAILED"):
            self.failed = True
        say(f"  -> {verdict}" + "".join(f"\n     problem: {p}" for p in problems))

    # --------------------------------------------------------- chaos run
    def chaos(self, cfg: str) -> None:
        a = self.args
        ref = self.reference(cfg)
        rng = random.Random(f"{a.seed}-{cfg}-chaos")
        n_plan = a.kills // 2
        plan = draw_plan(rng, n_plan, a.steps, a.every, a.keep)
        draws = [(rng.random(), rng.randrange(NPROC)) for _ in range(a.kills - n_plan)]
        t_steps = [e["t"] for e in ref.events if e["event"] == "step"][1:]  # after the warm-up step
        per_step = (t_steps[-1] - t_steps[0]) / max(len(t_steps) - 1, 1)
        killer = ExternalKiller(draws, per_step, a.steps)
        job = self.job(cfg, "chaos", restarts=a.kills + 2, plan=plan)
        say(f"  {cfg}: chaos run, {a.kills} kills ({n_plan} planned: "
            f"{'; '.join(describe_plan_kill(k) for k in plan)}; {len(draws)} external), "
            f"{per_step * 1e3:.0f} ms/step in the uninterrupted run after its warm-up")
        job.run(killer)
        res = check_run(job, ref, a.kills, killer.kills, a.every)
        res["problems"] += self.ref_problems.pop((cfg, NPROC), [])
        for k in killer.kills:
            say(f"     external kill in attempt {k['attempt']}: rank {k['rank']} (pid {k['pid']}), "
                f"{k['t']:.3f} s after the attempt's second step, after step {k['after_step']}")
        say(f"     attempts (start step -> last step logged): "
            + ", ".join(f"{x['start']}->{x['last']}" for x in res["attempts"])
            + f"; steps lost per kill: {res['lost']}"
            + (f"; {killer.deferred} external kill(s) deferred to a later attempt (a planned kill was due)"
               if killer.deferred else ""))
        self.row(cfg, "chaos", f"{res['survived']} of {a.kills}", res["restarts"],
                 f"{max(res['lost'], default=0)} (N={a.every})", verdict(res["problems"], "bitwise equal"),
                 job.wall, res["problems"])

    # ------------------------------------------------------- scenarios
    def first_save(self, cfg: str) -> None:
        a = self.args
        ref = self.reference(cfg)
        plan = [{"rank": 1, "step": a.every, "phase": "save-written", "action": "kill"},
                {"rank": 0, "step": a.every, "phase": "save-recorded", "action": "kill"}]
        say(f"  {cfg}: first-save: {'; '.join(describe_plan_kill(k) for k in plan)}")
        job = self.job(cfg, "first-save", restarts=4, plan=plan).run()
        res = check_run(job, ref, len(plan), [], a.every)
        res["problems"] += self.ref_problems.pop((cfg, NPROC), [])
        starts = [x["start"] for x in res["attempts"]]
        if starts[:3] != [0, 0, 0]:
            res["problems"].append(f"attempts started at steps {starts}, expected 0, 0, 0 (nothing committed)")
        say(f"     attempts started at steps {starts}; steps lost per kill: {res['lost']}")
        self.row(cfg, "first-save", f"{res['survived']} of {len(plan)}", res["restarts"],
                 f"{max(res['lost'], default=0)} (N={a.every})", verdict(res["problems"], "bitwise equal"),
                 job.wall, res["problems"])

    def full_disk(self, cfg: str) -> None:
        a = self.args
        ref = self.reference(cfg)
        rng = random.Random(f"{a.seed}-{cfg}-full-disk")
        saves = list(range(a.every, a.steps + 1, a.every))
        if len(saves) < 2:
            self.row(cfg, "full-disk", "-", "-", "-", "FAILED", 0.0, ["needs two saves (--steps >= 2 * --every)"])
            return
        good = rng.choice(saves[:-1])  # the last save that succeeds; the next one fails
        name = "full-disk"
        os.makedirs(os.path.join(a.workdir, cfg), exist_ok=True)
        mount = tempfile.mkdtemp(prefix="full-disk-ck-", dir=os.path.join(a.workdir, cfg))
        save_bytes = dir_bytes(newest_save(ref.ckpt_dir))
        size = ((a.keep + 2) * save_bytes + (1 << 20) + (1 << 20) - 1) >> 20 << 20
        tmpfs = (not a.no_tmpfs and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount],
                                                   capture_output=True).returncode == 0)
        try:
            if tmpfs:
                how = f"tmpfs of {size >> 20} MiB filled after save {good}"
                filler = Filler(mount, good)
                job = self.job(cfg, name, restarts=3, ckpt_dir=mount)
                say(f"  {cfg}: full-disk: {how} (a save is {save_bytes / 1e6:.2f} MB)")
                job.run(filler)
                expected = 0
                if filler.state != "emptied":
                    problems = [f"the filler was never removed (state {filler.state}): the failure did not happen"]
                else:
                    problems = []
                    say(f"     filled with {filler.bytes / 1e6:.2f} MB after the save of step {good}; "
                        f"removed once the restarted job resumed")
            else:
                rank = rng.randrange(NPROC)
                how = f"enospc plan action (rank {rank}'s file a link to /dev/full) at save {good + a.every}"
                plan = [{"rank": rank, "step": good + a.every, "phase": "save-begin", "action": "enospc"}]
                job = self.job(cfg, name, restarts=3, plan=plan, ckpt_dir=mount)
                say(f"  {cfg}: full-disk: {how} (mount -t tmpfs is not available here)")
                job.run()
                expected = 1
                problems = []
        finally:
            if tmpfs and subprocess.run(["umount", mount], capture_output=True).returncode:
                subprocess.run(["umount", "-l", mount], capture_output=True)
        res = check_run(job, ref, expected, [], a.every, other={0: "ENOSPC (tmpfs full)"} if tmpfs else None)
        res["problems"] = problems + res["problems"] + self.ref_problems.pop((cfg, NPROC), [])
        atts = [x for x in res["attempts"] if not any(k == "exit-abort" for k, _ in x["faults"])]
        out = job.output()
        if "No space left on device" not in out and "Errno 28" not in out:
            res["problems"].append("no 'No space left on device' in the output: the save did not fail for "
                                   "lack of space")
        if len(atts) != 2:
            res["problems"].append(f"{len(atts)} attempts, expected 2 (one failed save, one restart)")
        elif atts[1]["start"] != good:
            res["problems"].append(f"the restart resumed from step {atts[1]['start']}, expected the save before "
                                   f"the failed one ({good})")
        saved_fail = [e for e in job.events if e["event"] == "saved" and e["step"] == good + a.every
                      and atts and e["pid"] == job.starts()[0]["pid"]]
        if saved_fail:
            res["problems"].append(f"the save of step {good + a.every} succeeded in the first attempt")
        say(f"     attempts (start step -> last step logged): "
            + ", ".join(f"{x['start']}->{x['last']}" for x in atts) + f"; the save of step {good + a.every} failed "
            f"(ENOSPC), the restart loaded step {atts[1]['start'] if len(atts) > 1 else '-'}")
        self.row(cfg, f"full-disk ({'tmpfs' if tmpfs else 'enospc action'})", "1 ENOSPC of 1", res["restarts"],
                 f"{max(res['lost'], default=0)} (N={a.every})", verdict(res["problems"], "bitwise equal"),
                 job.wall, res["problems"])

    def resize(self, cfg: str) -> None:
        a = self.args
        ref2, ref1 = self.reference(cfg, 2), self.reference(cfg, 1)
        rng = random.Random(f"{a.seed}-{cfg}-resize")
        n = a.every
        stop_a = rng.choice([s for s in range(max(n + 1, a.steps // 4), a.steps // 2) if s % n] or [n + 1])
        stop_b = rng.choice([s for s in range(a.steps // 2 + 1, 3 * a.steps // 4 + 1) if s % n and s > stop_a + n]
                            or [stop_a + n + 1])
        os.makedirs(os.path.join(a.workdir, cfg), exist_ok=True)
        ck = tempfile.mkdtemp(prefix="resize-ck-", dir=os.path.join(a.workdir, cfg))
        stages = [(2, [{"rank": 0, "step": stop_a, "phase": "step-begin", "action": "kill"}]),
                  (1, [{"rank": 0, "step": stop_b, "phase": "step-begin", "action": "kill"}]),
                  (2, None)]
        say(f"  {cfg}: resize: 2 processes stopped at step {stop_a}, 1 process stopped at step {stop_b}, "
            f"2 processes to the end")
        jobs, problems, wall = [], [], 0.0
        for i, (nproc, plan) in enumerate(stages):
            job = self.job(cfg, f"resize/stage{i + 1}-w{nproc}", nproc, 0, plan=plan, ckpt_dir=ck).run()
            jobs.append(job)
            wall += job.wall
            starts = job.starts()
            expect_start = [0, stop_a // n * n, stop_b // n * n][i]
            if job.timed_out:
                problems.append(f"stage {i + 1} timed out")
            if plan is not None and (job.rc == 0 or 0 not in job.fired):
                problems.append(f"stage {i + 1} was not stopped by its planned kill (exit {job.rc})")
            if plan is None and job.rc != 0 and not (job.exit_aborts() and any(e["event"] == "done"
                                                                                for e in job.events)):
                problems.append(f"stage {i + 1} failed (exit {job.rc}): {job.problem_tail()}")
            if plan is None:
                problems += exit_abort_problems(job, f"stage {i + 1}")
            if len(starts) != 1 or starts[0]["step"] != expect_start or starts[0]["world"] != nproc:
                problems.append(f"stage {i + 1} started at {[(s['step'], s['world']) for s in starts]}, "
                                f"expected step {expect_start} at world {nproc}")
        # the last loss logged for each step, with the world size that logged it
        last: Dict[int, Tuple[str, int]] = {}
        for job in jobs:
            for st in job.starts():
                for e in job.attempt_events(st):
                    if e["event"] == "step":
                        last[e["step"]] = (e["loss"], st["world"])
        refs = {2: ref2.losses(), 1: ref1.losses()}
        worst, worst_step, equal_steps = 0.0, None, 0
        for step in range(1, a.steps + 1):
            if step not in last:
                problems.append(f"step {step} never logged")
                break
            got, world = float.fromhex(last[step][0]), last[step][1]
            want = float.fromhex(refs[world][step])
            equal_steps += got == want
            rel = abs(got - want) / max(abs(want), 1e-30)
            if rel > worst or rel != rel:
                worst, worst_step = rel, step
        f_got, f_want = jobs[-1].final_loss(), ref2.final_loss()
        f_rel = abs(f_got - f_want) / max(abs(f_want), 1e-30) if f_got is not None and f_want is not None \
            else float("inf")
        if not worst <= a.rtol:
            problems.append(f"loss curve: max relative difference {worst:.2e} at step {worst_step} > {a.rtol:g}")
        if not f_rel <= a.rtol:
            problems.append(f"final loss {f_got!r} vs {f_want!r}: relative difference {f_rel:.2e} > {a.rtol:g}")
        same_digest = jobs[-1].digest() == ref2.digest()
        lost = [stop_a - stop_a // n * n, stop_b - stop_b // n * n]
        say(f"     loss curve vs the uninterrupted run at the same world size: max relative difference "
            f"{worst:.2e} (step {worst_step}), {equal_steps} of {a.steps} steps bitwise equal; final loss "
            f"{f_got!r} vs {f_want!r}: relative difference {f_rel:.2e}; tolerance {a.rtol:g}; "
            f"final digest {'equal' if same_digest else 'differs (expected)'}")
        problems += self.ref_problems.pop((cfg, 1), []) + self.ref_problems.pop((cfg, 2), [])
        self.row(cfg, "resize 2->1->2", "2 stops of 2", 2, f"{max(lost)} (N={n})",
                 verdict(problems, f"within tolerance (max rel. {max(worst, f_rel):.1e} <= {a.rtol:g})"), wall,
                 problems)


class Filler:
    """``tick`` for the full-disk scenario: fill the tmpfs after save ``after`` is committed, empty it
    once the restarted attempt has resumed."""

    def __init__(self, mount: str, after: int):
        self.file = os.path.join(mount, "filler")
        self.after, self.state, self.bytes = after, "waiting", 0

    def __call__(self, job: Job) -> None:
        if self.state == "waiting":
            if any(e["event"] == "saved" and e["step"] == self.after for e in job.events):
                self.bytes = fill(self.file)
                self.state = "full"
        elif self.state == "full" and len(job.starts()) >= 2:
            os.remove(self.file)
            self.state = "emptied"


def fill(path: str) -> int:
    """Write ``path`` until the file system is full; the bytes written."""
    total = 0
    with open(path, "wb", buffering=0) as fh:
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            while True:
                try:
                    total += fh.write(block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return total


def newest_save(directory: str) -> str:
    steps = sorted(n for n in os.listdir(directory) if n.startswith("step-"))
    return os.path.join(directory, steps[-1])


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ------------------------------------------------------------------ output
def say(text: str) -> None:
    print(text, flush=True)


def table(rows: List[Dict[str, Any]]) -> List[str]:
    head = ("config", "run", "kills survived", "restarts", "max steps lost", "verdict", "wall time")
    body = [(r["config"], r["what"], r["kills"], str(r["restarts"]), r["lost"], r["verdict"], f"{r['wall']:.0f} s")
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(b) for b in body]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)} "
                   f"(default: all)")
    p.add_argument("--kills", type=int, default=10, help="kills per chaos run (default: 10; half planned)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.add_argument("--every", type=int, default=5, help="steps between saves (default: 5)")
    p.add_argument("--keep", type=int, default=2, help="saves kept (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the model and the kill draws (default: 0)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch (default: 256; even)")
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="the demo's LR schedule (default: cosine: the scheduler's state is resumed too)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, of {', '.join(SCENARIOS)}, or 'none' (default: all)")
    p.add_argument("--scenario-configs", default=None,
                   help="configurations the scenarios run on (default: those of --configs)")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="relative tolerance of the resize scenario's losses (default: 1e-4)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun job (default: 600)")
    p.add_argument("--no-tmpfs", action="store_true", help="full-disk: use the enospc plan action, not a tmpfs")
    p.add_argument("--workdir", default=None, help="where the jobs' files go (default: a new directory in /tmp)")
    p.add_argument("--keep-files", action="store_true", help="keep --workdir (kept anyway when a run fails)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the running job is killed on the way out
    configs = [c for c in args.configs.split(",") if c]
    scen_configs = [c for c in (args.scenario_configs or args.configs).split(",") if c]
    scenarios = [] if args.scenarios == "none" else [s for s in args.scenarios.split(",") if s]
    for c in configs + scen_configs:
        if c not in CONFIGS:
            p.error(f"unknown configuration {c!r}; known: {', '.join(CONFIGS)}")
    for s in scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    if args.kills < 0 or args.steps < 1 or args.every < 1 or args.keep < 1 or args.batch_size % 2:
        p.error("--kills >= 0, --steps >= 1, --every >= 1, --keep >= 1, --batch-size even")
    own_dir = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="funcopt-chaos-")
    args.workdir = os.path.abspath(args.workdir)

    import torch

    command = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
                       + (argv if argv is not None else sys.argv[1:]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    load0 = os.getloadavg()
    say(f"# chaos: {command}")
    say(f"# torch {torch.__version__}, funcopt commit {commit}, {os.cpu_count()} CPUs, load average "
        f"{' / '.join(f'{x:.2f}' for x in load0)}; files in {args.workdir}")
    say(f"# {NPROC} processes (torchrun --standalone, gloo on loopback), {args.steps} steps, save every "
        f"{args.every}, keep {args.keep}, global batch {args.batch_size}, {args.lr_schedule} LR schedule, "
        f"seed {args.seed}, {args.kills} kills per chaos run, timeout {args.timeout:.0f} s per job")
    bench = Bench(args)
    t0 = time.monotonic()
    for cfg in configs:
        say(f"\n## {cfg}")
        try:
            bench.chaos(cfg)
        except RuntimeError as e:
            bench.row(cfg, "chaos", "-", "-", "-", "FAILED", 0.0, [str(e)])
    steps = {"first-save": bench.first_save, "full-disk": bench.full_disk, "resize": bench.resize}
    for cfg in scen_configs if scenarios else []:
        say(f"\n## {cfg}: scenarios")
        for s in scenarios:
            try:
                steps[s](cfg)
            except RuntimeError as e:
                bench.row(cfg, s, "-", "-", "-", "FAILED", 0.0, [str(e)])
    say("")
    say(f"# chaos: {command}")
    say(f"# torch {torch.__version__}, commit {commit}; load average at the start "
        f"{' / '.join(f'{x:.2f}' for x in load0)}, at the end {' / '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"total {time.monotonic() - t0:.0f} s")
    say(f"# {args.steps} steps, a save every {args.every} (N), keep {args.keep}, {args.kills} kills per chaos run "
        f"(half planned, half external); wall time: the chaos run (resize: its three jobs); the resize tolerance "
        f"is {args.rtol:g} relative")
    say("")
    for line in table(bench.rows):
        say(line)
    for r in bench.rows:
        for prob in r["problems"]:
            say(f"- {r['config']} {r['what']}: {prob}")
    if bench.failed or args.keep_files or not own_dir:
        say(f"\nfiles kept in {args.workdir}")
    else:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())

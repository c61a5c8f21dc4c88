#!/usr/bin/env python
"""Issue 23's six optimizers against their oracles outside torch: loss curves and step times.

The classes and their oracles (``REGISTRY[name].torch_cls``)::

    funcopt.AdamWScheduleFree  schedulefree.AdamWScheduleFree
    funcopt.SGDScheduleFree    schedulefree.SGDScheduleFree
    funcopt.Prodigy            prodigyopt.Prodigy
    funcopt.ADOPT              pytorch_optimizer.ADOPT
    funcopt.AdEMAMix           pytorch_optimizer.AdEMAMix
    funcopt.SOAP               pytorch_optimizer.SOAP   (left out where this checkout has no SOAP)

**Part 1, ``--curves``: loss curves.**  A character-level language model (an
MLP over the last ``CTX`` characters: embedding, two hidden layers with a
LayerNorm, a softmax over the characters) trained on a few KB of
public-domain English (``TEXT`` below; the last 10% held out) for ``--train-steps``
steps, float32, one intra-op thread, with each algorithm three ways: funcopt
eager, ``funcopt.script``-ed, and the oracle.  Same initial weights, same
batches, same hyperparameters (``HYPER``: each algorithm's usual settings).
Schedule-Free: ``train()`` before stepping and ``eval()`` before every
evaluation, on funcopt and on the oracle alike (funcopt starts in train mode;
the oracle needs the call); the held-out loss is taken in eval mode (at the
average ``x``), then ``train()`` again.  Prints per algorithm the training
loss every ``--every`` steps and the held-out loss, with ``|funcopt - oracle|``,
the maximum of those over every step, how many steps' losses were bitwise
equal, and the largest parameter difference at the end.  Funcopt and its
oracle should agree to rounding (the module docstrings say bitwise in eager
float32 where the formula is the oracle's): a larger difference is a bug.

**Part 2, ``--steps``: step time.**  One ``step()`` of funcopt (eager and
scripted, ``impl="auto"``) against the oracle (for Schedule-Free, ADOPT and
AdEMAMix both of the oracle's paths, ``foreach=True`` and ``foreach=False``;
the ratio is to the faster one by median) over a 1M and a 16M-element float32
parameter set: four square matrices and four vectors (1M: 4 x 512x512 + 4 x
512; 16M: 4 x 2048x2048 + 4 x 2048).  The peers are interleaved (every repeat
runs each peer once, the starting peer rotating); before each timed step the
peer's own gradient tensors are refilled from the fixed gradients, untimed,
for every peer alike (the Schedule-Free oracles divide ``p.grad`` in place).
Each ratio is the median of the per-repeat ratios (peers of the same repeat),
its spread p10-p90 over the repeats.

For the elementwise algorithms (all but SOAP) also the ratio to the memory
limit: ``BYTES[algo]`` per fp32 parameter element (below) x elements / the
bandwidth, the best ``a.add_(b)`` over 64M floats (12 B per element:
``funcopt.bench._step_parts.measure_bandwidth``) measured in the same run,
before and after the step cases.  SOAP is matmul-bound (the projections onto
its eigenbases, the Kronecker factors' updates, a QR every
``precondition_frequency`` steps): no memory limit is given for it, and at 16M
it is timed over fewer repeats (``--soap-repeats-16m``: each step takes
seconds).

Figures of record come from an idle machine; the load average is printed at
the start and at the end, with the share of a CPU this process got in each case::

    python benchmarks/new_optimizers.py                 # both parts (4.5-5 min measured on 2 busy vCPUs)
    python benchmarks/new_optimizers.py --curves        # loss curves only
    python benchmarks/new_optimizers.py --steps --sizes 1M --repeats 20
    python benchmarks/new_optimizers.py --steps --sizes tiny   # 4 x 8x8 + 4 x 8: each step's fixed cost
    python benchmarks/new_optimizers.py --algos ADOPT,Prodigy --json out.json --markdown out.md
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import funcopt
from funcopt.bench._step_parts import measure_bandwidth, no_gc
from funcopt.registry import REGISTRY

ALGOS = ("AdamWScheduleFree", "SGDScheduleFree", "Prodigy", "ADOPT", "AdEMAMix", "SOAP")
SCHEDULE_FREE = ("AdamWScheduleFree", "SGDScheduleFree")
# the oracle has a foreach switch (time both of its paths)
ORACLE_FOREACH = ("AdamWScheduleFree", "SGDScheduleFree", "ADOPT", "AdEMAMix")

# Each algorithm's usual hyperparameters (the same for funcopt and the oracle; the
# loss curves and the step times).  AdEMAMix's alpha/beta3 warm up over the run.
TRAIN_STEPS = 300
HYPER: Dict[str, Dict[str, Any]] = {
    "AdamWScheduleFree": dict(lr=2.5e-3, warmup_steps=30, weight_decay=1e-2),
    "SGDScheduleFree": dict(lr=0.5, momentum=0.9, warmup_steps=30),
    "Prodigy": dict(lr=1.0, weight_decay=1e-2),
    "ADOPT": dict(lr=2e-3),
    "AdEMAMix": dict(lr=2e-3, t_alpha_beta3=TRAIN_STEPS),
    "SOAP": dict(lr=3e-3, precondition_frequency=10),
}

# One pass's memory traffic per fp32 parameter element (bytes), steady state: what the
# update must read and write at the least.
BYTES: Dict[str, Tuple[int, str]] = {
    "AdamWScheduleFree": (28, "read p (= y), g, z, v; write p, z, v"),
    "SGDScheduleFree": (20, "read p (= y), g, z; write p, z"),
    "Prodigy": (52, "two passes (the update needs d, a sum over every element, first): "
                    "1) read g, p, p0, s, m, v; write s, m, v (36 B); 2) read p, m, v; write p (16 B); "
                    "one pass would be 40 B but cannot be"),
    "ADOPT": (28, "read p, g, m, v; write p, m, v"),
    "AdEMAMix": (36, "read p, g, m1, m2 (slow EMA), v; write p, m1, m2, v"),
}

# --------------------------------------------------------------------------- the text
# Public-domain English: the Gettysburg Address (1863), Shakespeare's Sonnet 18 (1609),
# the Declaration of Independence's preamble (1776), the opening of Pride and
# Prejudice (1813) and of Moby-Dick (1851).
TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.
Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.
But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far above \
our poor power to add or detract. The world will little note, nor long remember what we say \
here, but it can never forget what they did here. It is for us the living, rather, to be \
dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- \
that from these honored dead we take increased devotion to that cause for which they gave the \
last full measure of devotion -- that we here highly resolve that these dead shall not have \
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that \
government of the people, by the people, for the people, shall not perish from the earth.

Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.

When in the Course of human events, it becomes necessary for one people to dissolve the \
political bands which have connected them with another, and to assume among the powers of the \
earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle \
them, a decent respect to the opinions of mankind requires that they should declare the causes \
which impel them to the separation.
We hold these truths to be self-evident, that all men are created equal, that they are endowed \
by their Creator with certain unalienable Rights, that among these are Life, Liberty and the \
pursuit of Happiness. That to secure these rights, Governments are instituted among Men, \
deriving their just powers from the consent of the governed, That whenever any Form of \
Government becomes destructive of these ends, it is the Right of the People to alter or to \
abolish it, and to institute new Government, laying its foundation on such principles and \
organizing its powers in such form, as to them shall seem most likely to effect their Safety \
and Happiness.

It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife.
However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he \
is considered the rightful property of some one or other of their daughters.
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?"
Mr. Bennet replied that he had not.
"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."
Mr. Bennet made no answer.
"Do you not want to know who has taken it?" cried his wife impatiently.
"You want to tell me, and I have no objection to hearing it."
This was invitation enough.

Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money \
in my purse, and nothing particular to interest me on shore, I thought I would sail about a \
little and see the watery part of the world. It is a way I have of driving off the spleen and \
regulating the circulation. Whenever I find myself growing grim about the mouth; whenever it is \
a damp, drizzly November in my soul; whenever I find myself involuntarily pausing before coffin \
warehouses, and bringing up the rear of every funeral I meet; and especially whenever my hypos \
get such an upper hand of me, that it requires a strong moral principle to prevent me from \
deliberately stepping into the street, and methodically knocking people's hats off -- then, I \
account it high time to get to sea as soon as I can. This is my substitute for pistol and ball. \
With a philosophical flourish Cato throws himself upon his sword; I quietly take to the ship. \
There is nothing surprising in this. If they but knew it, almost all men in their degree, some \
time or other, cherish very nearly the same feelings towards the ocean with me.
"""

CTX, EMB, HIDDEN, BATCH, EVAL_WINDOWS = 16, 24, 256, 64, 512


class CharMLP(torch.nn.Module):
    """Embedding of the last CTX characters -> Linear -> LayerNorm -> GELU -> Linear -> GELU -> logits."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, EMB)
        self.fc1 = torch.nn.Linear(CTX * EMB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).flatten(1)
        h = torch.nn.functional.gelu(self.norm(self.fc1(h)))
        return self.out(torch.nn.functional.gelu(self.fc2(h)))


def make_data(steps: int, seed: int) -> Dict[str, Any]:
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    train, held = ids[:cut], ids[cut:]
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - CTX, (steps, BATCH), generator=gen)
    offs = torch.arange(CTX + 1)
    batches = train[starts[..., None] + offs]  # steps x BATCH x (CTX + 1)
    estarts = torch.linspace(0, len(held) - CTX - 1, EVAL_WINDOWS).long()
    held_w = held[estarts[:, None] + offs]
    return dict(vocab=len(chars), batches=batches, held=held_w, chars=len(TEXT), train_chars=cut)


def loss_of(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(windows[:, :CTX]), windows[:, CTX])


def build_opt(algo: str, kind: str, params: List[torch.Tensor], kw: Dict[str, Any]) -> Any:
    """``kind``: "funcopt eager", "funcopt script", "oracle" (its default path),
    "oracle foreach=False"."""
    spec = REGISTRY[algo]
    if kind.startswith("funcopt"):
        opt = getattr(funcopt, algo)(params, **kw)
        return funcopt.script(opt) if kind == "funcopt script" else opt
    okw = dict(kw)
    if kind == "oracle foreach=False":
        okw["foreach"] = False
    opt = spec.torch_cls(params, **okw)
    if algo in SCHEDULE_FREE:
        opt.train()  # the oracle starts in eval mode and refuses to step there
    return opt


def train_run(algo: str, kind: str, init: Dict[str, torch.Tensor], data: Dict[str, Any], steps: int,
              every: int) -> Dict[str, Any]:
    model = CharMLP(data["vocab"])
    model.load_state_dict(init)
    opt = build_opt(algo, kind, list(model.parameters()), HYPER[algo])
    sf = algo in SCHEDULE_FREE
    train_loss: List[float] = []
    held_loss: Dict[int, float] = {}

    def evaluate(k: int) -> None:
        if sf:
            opt.eval()
        with torch.no_grad():
            held_loss[k] = float(loss_of(model, data["held"]))
        if sf:
            opt.train()

    evaluate(0)
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        if sf:
            opt.train()  # a no-op in train mode: as a training loop written for the oracle calls it
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, data["batches"][k - 1])
        loss.backward()
        opt.step()
        train_loss.append(float(loss.detach()))
        if k % every == 0 or k == steps:
            evaluate(k)
    if sf:
        opt.eval()  # the final parameters: the average x
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(train=train_loss, held=held_loss, params=final, seconds=time.perf_counter() - t0)


def curves(algos: Sequence[str], args: argparse.Namespace, out: Dict[str, Any], md: List[str]) -> None:
    data = make_data(args.train_steps, seed=1)
    torch.manual_seed(0)
    init = copy.deepcopy(CharMLP(data["vocab"]).state_dict())
    nparams = sum(v.numel() for v in init.values())
    print(f"\n== Loss curves: char-level MLP LM ({nparams:,} parameters, context {CTX}, vocabulary "
          f"{data['vocab']}), {data['chars']} characters of text ({data['train_chars']} trained on), batch {BATCH}, "
          f"{args.train_steps} steps, float32, {torch.get_num_threads()} intra-op thread(s); held-out loss over "
          f"{EVAL_WINDOWS} windows of the last 10%", flush=True)
    md.append(f"Char-level MLP LM, {nparams:,} parameters, batch {BATCH}, {args.train_steps} steps, float32. "
              "Training loss of the step's batch; held-out loss (eval mode for Schedule-Free) at the given "
              "steps. `|d|` = |funcopt - oracle|.\n")
    kinds = ("funcopt eager", "funcopt script", "oracle")
    out["curves"] = {}
    for algo in algos:
        runs, failed = {}, {}
        for k in kinds:
            try:
                runs[k] = train_run(algo, k, init, data, args.train_steps, args.every)
            except Exception as exc:  # a failure is a finding: reported, the other runs go on
                failed[k] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
                print(f"\n-- {algo}: {k} FAILED: {failed[k]}", flush=True)
        if "funcopt eager" in failed or "oracle" in failed:
            out["curves"][algo] = dict(failed=failed)
            md.append(f"**{algo}**: no curve, {'; '.join(f'{k} failed ({v})' for k, v in failed.items())}.\n")
            continue
        if "funcopt script" in failed:  # the eager run stands in: its |d| columns repeat
            runs["funcopt script"] = runs["funcopt eager"]
        e, s, o = (runs[k] for k in kinds)
        dtrain_e = [abs(a - b) for a, b in zip(e["train"], o["train"])]
        dtrain_s = [abs(a - b) for a, b in zip(s["train"], o["train"])]
        dheld_e = [abs(e["held"][k] - o["held"][k]) for k in o["held"]]
        dheld_s = [abs(s["held"][k] - o["held"][k]) for k in o["held"]]
        dparam_e = max(float((e["params"][n] - o["params"][n]).abs().max()) for n in o["params"])
        dparam_s = max(float((s["params"][n] - o["params"][n]).abs().max()) for n in o["params"])
        equal_e = sum(a == b for a, b in zip(e["train"], o["train"]))
        equal_s = sum(a == b for a, b in zip(s["train"], o["train"]))
        print(f"\n-- {algo} {HYPER[algo]}  (seconds per run: eager {e['seconds']:.1f}, script {s['seconds']:.1f}, "
              f"oracle {o['seconds']:.1f})")
        head = f"{'step':>5} | {'train funcopt':>13} {'train oracle':>13} {'|d| eager':>10} {'|d| script':>10} | " \
               f"{'held funcopt':>12} {'held oracle':>12} {'|d| eager':>10} {'|d| script':>10}"
        print(head)
        print("-" * len(head))
        rows = []
        for k in sorted(o["held"]):
            tr = (f"{e['train'][k - 1]:13.6f} {o['train'][k - 1]:13.6f} {abs(e['train'][k - 1] - o['train'][k - 1]):10.2e} "
                  f"{abs(s['train'][k - 1] - o['train'][k - 1]):10.2e}") if k > 0 else f"{'-':>13} {'-':>13} {'-':>10} {'-':>10}"
            print(f"{k:5d} | {tr} | {e['held'][k]:12.6f} {o['held'][k]:12.6f} {abs(e['held'][k] - o['held'][k]):10.2e} "
                  f"{abs(s['held'][k] - o['held'][k]):10.2e}")
            rows.append(k)
        print(f"max |d| over all {args.train_steps} steps: training loss eager {max(dtrain_e):.2e}, script "
              f"{max(dtrain_s):.2e}; held-out loss eager {max(dheld_e):.2e}, script {max(dheld_s):.2e}; bitwise-equal "
              f"training losses: eager {equal_e}/{args.train_steps}, script {equal_s}/{args.train_steps}; final "
              f"parameters max |d|: eager {dparam_e:.2e}, script {dparam_s:.2e}", flush=True)
        if failed:
            print(f"NOTE: {'; '.join(f'{k} failed ({v})' for k, v in failed.items())}: the script columns repeat eager's")
        out["curves"][algo] = dict(failed=failed, hyper={k: v for k, v in HYPER[algo].items()}, train={k: runs[k]["train"] for k in kinds},
                                   held={k: {str(i): v for i, v in runs[k]["held"].items()} for k in kinds},
                                   max_dtrain_eager=max(dtrain_e), max_dtrain_script=max(dtrain_s),
                                   max_dheld_eager=max(dheld_e), max_dheld_script=max(dheld_s),
                                   equal_eager=equal_e, equal_script=equal_s, max_dparam_eager=dparam_e,
                                   max_dparam_script=dparam_s, seconds={k: runs[k]["seconds"] for k in kinds})
        # Markdown: every md_every steps + the last
        kw = ", ".join(f"{k}={v}" for k, v in HYPER[algo].items())
        md.append(f"**{algo}** (`{kw}`)\n")
        md.append("| step | train funcopt | train oracle | \\|d\\| eager | \\|d\\| script | held-out funcopt | "
                  "held-out oracle | \\|d\\| eager | \\|d\\| script |")
        md.append("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for k in sorted(o["held"]):
            if k % args.md_every and k != args.train_steps and k != 0:
                continue
            tr = (f"{e['train'][k - 1]:.5f} | {o['train'][k - 1]:.5f} | {abs(e['train'][k - 1] - o['train'][k - 1]):.1e} | "
                  f"{abs(s['train'][k - 1] - o['train'][k - 1]):.1e}") if k > 0 else "- | - | - | -"
            md.append(f"| {k} | {tr} | {e['held'][k]:.5f} | {o['held'][k]:.5f} | "
                      f"{abs(e['held'][k] - o['held'][k]):.1e} | {abs(s['held'][k] - o['held'][k]):.1e} |")
        md.append(f"| max over the run | | | {max(dtrain_e):.1e} | {max(dtrain_s):.1e} | | | {max(dheld_e):.1e} | "
                  f"{max(dheld_s):.1e} |\n")
        if failed:
            md.append(f"`funcopt.script` failed ({failed['funcopt script']}): the scripted columns repeat eager's.\n")
        md.append(f"Bitwise-equal training losses: eager {equal_e}/{args.train_steps}, scripted "
                  f"{equal_s}/{args.train_steps}; final parameters, max \\|funcopt - oracle\\|: eager {dparam_e:.1e}, "
                  f"scripted {dparam_s:.1e}.\n")


# --------------------------------------------------------------------------- step times
def shapes_of(size: str) -> List[Tuple[int, ...]]:
    d = {"tiny": 8, "1M": 512, "16M": 2048}[size]  # tiny: 320 elements, the per-step fixed cost
    return [(d, d)] * 4 + [(d,)] * 4


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def step_peer(algo: str, kind: str, base: List[torch.Tensor], grads: List[torch.Tensor]
              ) -> Tuple[Callable[[], Any], Callable[[], Any]]:
    """(prepare, step): ``prepare`` refills the peer's own gradients (untimed)."""
    params = [p.clone() for p in base]
    own = [g.clone() for g in grads]
    opt = build_opt(algo, kind, params, HYPER[algo])
    if kind.startswith("funcopt"):
        step = lambda: opt.step(own)  # noqa: E731
    else:
        for p, g in zip(params, own):
            p.grad = g
        step = opt.step

    def prepare() -> None:
        torch._foreach_copy_(own, grads)

    return prepare, step


def interleaved(peers: List[Tuple[Callable[[], Any], Callable[[], Any]]], warmup: int, repeats: int
                ) -> List[List[float]]:
    n = len(peers)
    times: List[List[float]] = [[] for _ in peers]
    with no_gc():
        for r in range(warmup + repeats):
            for k in range(n):
                j = (r + k) % n
                prepare, step = peers[j]
                prepare()
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                if r >= warmup:
                    times[j].append(dt)
    return times


def peer_kinds(algo: str) -> List[str]:
    kinds = ["funcopt eager", "funcopt script", "oracle"]
    if algo in ORACLE_FOREACH:
        kinds.append("oracle foreach=False")
    return kinds


def oracle_label(algo: str, kind: str) -> str:
    if kind == "oracle foreach=False":
        return "for-loop"
    return "foreach" if algo in ORACLE_FOREACH else "-"


def step_case(algo: str, size: str, args: argparse.Namespace, bw: float) -> Dict[str, Any]:
    shapes = shapes_of(size)
    numel = sum(math.prod(s) for s in shapes)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    kinds, peers, failed = [], [], {}
    for k in peer_kinds(algo):
        try:
            peers.append(step_peer(algo, k, base, grads))
            kinds.append(k)
        except Exception as exc:  # a failure is a finding: reported, the other peers go on
            failed[k] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            print(f"\n-- {algo}, {size}: {k} FAILED: {failed[k]}", flush=True)
    del base
    warmup, repeats = args.warmup, args.repeats or (10 if size == "16M" else 30)
    if algo == "SOAP" and size == "16M":
        warmup, repeats = 1, args.soap_repeats_16m
    c0, w0 = time.process_time(), time.perf_counter()
    times = interleaved(peers, warmup, repeats)
    wall = time.perf_counter() - w0
    share = (time.process_time() - c0) / wall
    del peers
    med = {k: statistics.median(t) for k, t in zip(kinds, times)}
    oracles = [k for k in kinds if k.startswith("oracle")]
    best = min(oracles, key=lambda k: med[k])
    tb = dict(zip(kinds, times))
    res: Dict[str, Any] = dict(algo=algo, size=size, numel=numel, tensors=len(shapes), warmup=warmup, failed=failed,
                               repeats=repeats, cpu_share=share, loadavg=os.getloadavg(), best_oracle=best,
                               times_s=tb, median_ms={k: 1e3 * v for k, v in med.items()},
                               mean_ms={k: 1e3 * statistics.fmean(t) for k, t in tb.items()},
                               p10_ms={k: 1e3 * quantile(t, 0.1) for k, t in tb.items()},
                               p90_ms={k: 1e3 * quantile(t, 0.9) for k, t in tb.items()})
    res["ratio"] = {}
    for k in ("funcopt eager", "funcopt script"):
        if k not in tb:
            continue
        rs = [a / b for a, b in zip(tb[k], tb[best])]
        res["ratio"][k] = dict(median=statistics.median(rs), p10=quantile(rs, 0.1), p90=quantile(rs, 0.9))
    if algo in BYTES:
        limit = BYTES[algo][0] * numel / (bw * 1e9)
        res["limit_ms"] = 1e3 * limit
        res["bytes"] = BYTES[algo][0]
        res["to_limit"] = {k: med[k] / limit for k in kinds}
    print_step_case(res)
    return res


def print_step_case(res: Dict[str, Any]) -> None:
    algo, kinds = res["algo"], list(res["median_ms"])
    lim = f", limit {res['limit_ms']:.2f} ms ({res['bytes']} B/elem)" if "limit_ms" in res else ", no memory limit (matmul-bound)"
    print(f"\n-- {algo}, {res['size']} ({res['numel']:,} elements in {res['tensors']} tensors), {res['repeats']} repeats "
          f"after {res['warmup']} warm-up{lim}; this process got {res['cpu_share']:.2f} CPU, load avg "
          f"{res['loadavg'][0]:.2f}")
    head = f"{'peer':<22} {'median ms':>10} {'p10..p90 ms':>19} {'mean ms':>9} {'/ best oracle (p10-p90)':>26} {'/ limit':>8}"
    print(head)
    print("-" * len(head))
    for k in kinds:
        r = res["ratio"].get(k)
        rr = f"{r['median']:.2f}x ({r['p10']:.2f}-{r['p90']:.2f})" if r else ("(best oracle)" if k == res["best_oracle"] else "")
        tl = f"{res['to_limit'][k]:.2f}x" if "to_limit" in res else "-"
        print(f"{k:<22} {res['median_ms'][k]:10.2f} {res['p10_ms'][k]:8.2f}..{res['p90_ms'][k]:<9.2f} "
              f"{res['mean_ms'][k]:9.2f} {rr:>26} {tl:>8}", flush=True)
    for k, v in res["failed"].items():
        print(f"{k:<22} FAILED: {v}")


def steps_part(algos: Sequence[str], args: argparse.Namespace, out: Dict[str, Any], md: List[str]) -> None:
    print(f"\n== Step times: {torch.get_num_threads()} intra-op thread(s); bytes per fp32 element of one pass:")
    for a in algos:
        print(f"   {a}: " + (f"{BYTES[a][0]} B ({BYTES[a][1]})" if a in BYTES else "- (matmul-bound)"))
    bws: List[float] = []
    cases = []
    for size in args.sizes.split(","):
        bws.append(measure_bandwidth()["inplace_best"])
        print(f"\nbandwidth (best a.add_(b) over 64M fp32, 12 B/elem) before the {size} cases: {bws[-1]:.1f} GB/s "
              f"(the limits printed below use it)", flush=True)
        for algo in algos:
            cases.append(step_case(algo, size, args, bws[-1]))
    bws.append(measure_bandwidth()["inplace_best"])
    bw = max(bws)
    print(f"\nbandwidth after the cases: {bws[-1]:.1f} GB/s; the best of the run, {bw:.1f} GB/s, sets the limits "
          "in the summary below")
    for c in cases:  # the summary's limits: the best bandwidth of the run
        if "limit_ms" in c:
            limit = c["bytes"] * c["numel"] / (bw * 1e9)
            c["limit_ms"] = 1e3 * limit
            c["to_limit"] = {k: v / 1e3 / limit for k, v in c["median_ms"].items()}
    out["bandwidth_GBps"] = bws
    out["steps"] = cases
    md.append(f"Bandwidth (best `a.add_(b)`, 64M floats, 12 B/element): {', '.join(f'{b:.1f}' for b in bws)} GB/s "
              f"(before each size, after the last); the limits use the best, {bw:.1f} GB/s. Milliseconds per "
              "step: median (p10..p90); ratio: median of the per-repeat ratios to the fastest oracle path "
              "(p10-p90).\n")
    first = len(md)
    md.append("| algorithm | size | funcopt eager ms | funcopt scripted ms | oracle ms (path) | eager / oracle | "
              "scripted / oracle | limit ms (B/elem) | scripted / limit | oracle / limit | CPU share |")
    md.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for c in cases:
        m, p10, p90, b = c["median_ms"], c["p10_ms"], c["p90_ms"], c["best_oracle"]

        def ms(k: str) -> str:
            if k not in m:
                return "failed"
            return f"{m[k]:.2f} ({p10[k]:.2f}..{p90[k]:.2f})"

        def rt(k: str) -> str:
            if k not in c["ratio"]:
                return "-"
            r = c["ratio"][k]
            return f"**{r['median']:.2f}x** ({r['p10']:.2f}-{r['p90']:.2f})"

        others = [k for k in m if k.startswith("oracle") and k != b]
        orc = ms(b) + f" ({oracle_label(c['algo'], b)})" + "".join(
            f"; {oracle_label(c['algo'], k)} {m[k]:.2f}" for k in others)
        if "limit_ms" in c:
            lim = f"{c['limit_ms']:.2f} ({c['bytes']})"
            tl = f"{c['to_limit']['funcopt script']:.2f}x" if "funcopt script" in m else "-"
            to = f"{c['to_limit'][b]:.2f}x"
        else:
            lim = tl = to = "- (matmuls)"
        reps = f" [{c['repeats']} repeats]" if c["algo"] == "SOAP" and c["size"] == "16M" else ""
        md.append(f"| {c['algo']}{reps} | {c['size']} | {ms('funcopt eager')} | {ms('funcopt script')} | {orc} | "
                  f"{rt('funcopt eager')} | {rt('funcopt script')} | {lim} | {tl} | {to} | {c['cpu_share']:.2f} |")
    fails = [f"{c['algo']} {c['size']}: {k} failed ({v})" for c in cases for k, v in c["failed"].items()]
    if fails:
        md.append("\nNot timed: " + "; ".join(fails) + ".")
    md.append("")
    print(f"\nSummary: step times against the fastest oracle path and the memory limit ({bw:.1f} GB/s)")
    print("\n".join(md[first:]))


# --------------------------------------------------------------------------- main
def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "?"
    except OSError:
        return "?"


def tree_note() -> str:
    """The funcopt/ files that differ from HEAD (the figures are of the working tree, not of the commit),
    or where funcopt was imported from when that is not this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    where = os.path.dirname(os.path.abspath(funcopt.__file__))
    if os.path.dirname(where) != root:
        return f"funcopt imported from {where}, not from this checkout"
    try:
        r = subprocess.run(["git", "status", "--porcelain", "--", ":/funcopt"], capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    except OSError:
        return ""
    files = [line[3:] for line in r.stdout.splitlines() if line.strip()]
    return f"working tree differs from the commit in {', '.join(files)}" if files else ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curves", action="store_true", help="the loss curves (default: both parts)")
    ap.add_argument("--steps", action="store_true", help="the step times (default: both parts)")
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    ap.add_argument("--every", type=int, default=25, help="held-out loss and table row every N steps")
    ap.add_argument("--md-every", type=int, default=50, help="Markdown table rows every N steps")
    ap.add_argument("--sizes", default="1M,16M")
    ap.add_argument("--repeats", type=int, default=0, help="timed repeats (default 10 at 16M, else 30)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--soap-repeats-16m", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: steadier on a shared machine)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--markdown", help="write the tables here (Markdown)")
    args = ap.parse_args(argv)
    if not args.curves and not args.steps:
        args.curves = args.steps = True
    torch.set_num_threads(args.threads)
    algos = []
    for a in args.algos.split(","):
        if a not in REGISTRY or not hasattr(funcopt, a):
            print(f"({a}: not in this checkout's registry, left out)")
            continue
        algos.append(a)
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    head = (f"funcopt {commit()}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs ({cpu_model()}), {torch.get_num_threads()} intra-op thread(s); "
            f"load average at the start {' / '.join(f'{x:.2f}' for x in load0)}")
    dirty = tree_note()
    if dirty:
        head += f"; {dirty}"
    print(head, flush=True)
    out: Dict[str, Any] = dict(commit=commit(), torch=torch.__version__, cpus=os.cpu_count(), cpu=cpu_model(),
                               threads=torch.get_num_threads(), loadavg_start=load0, argv=sys.argv[1:])
    md: List[str] = []
    if args.curves:
        md.append("### Loss curves\n")
        curves(algos, args, out, md)
    if args.steps:
        md.append("### Step times\n")
        steps_part(algos, args, out, md)
    load1 = os.getloadavg()
    total = time.perf_counter() - t_start
    print(f"\nload average at the end {' / '.join(f'{x:.2f}' for x in load1)}; total {total:.0f} s")
    out["loadavg_end"], out["seconds"] = load1, total
    md.insert(0, f"{head}; at the end {' / '.join(f'{x:.2f}' for x in load1)}; {total:.0f} s in all.\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

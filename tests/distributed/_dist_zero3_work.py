"""ZeRO-3 cases run inside spawned ranks (see test_zero3.py), and their single-process references.

Every training case is described by a dict (model, optimizer, options); the
same builders run the distributed case (:func:`run_case`, in the ranks) and
the reference (:func:`reference`, in the parent: the unsharded model,
``torch.optim`` on the full batch).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

import funcopt
from funcopt.distributed import DistributedError, Zero3Layer, Zero3Sequential, zero3
from _dist_harness import run_cases

BATCH = 24  # divisible by 1, 2, 3, 4 (and by 2 micro-batches)
D_IN, D_OUT = 6, 3
STEPS = 4
OPTS = {
    "SGD": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "Adam": dict(lr=0.01, weight_decay=0.01),
    "AdamW": dict(lr=0.01, weight_decay=0.1, amsgrad=True),
    "Adagrad": dict(lr=0.05, weight_decay=0.01),
    # the rules beyond torch (issue 23; oracles: tests/_oracles.py): per-group counters on each
    # rank's chunks; Prodigy's d summed over the ranks' chunks (funcopt_process_group)
    "Prodigy": dict(lr=1.0, weight_decay=0.01, d_coef=2.0, use_bias_correction=True),
    "AdamWScheduleFree": dict(lr=0.01, weight_decay=0.01, warmup_steps=2),
    "SGDScheduleFree": dict(lr=0.05, momentum=0.9, weight_decay=0.01, warmup_steps=2),
    "ADOPT": dict(lr=0.01, weight_decay=0.01),
    "AdEMAMix": dict(lr=0.01, weight_decay=0.01, t_alpha_beta3=5.0),
}


# ------------------------------------------------------------------ models
def stack_modules(frozen: bool = False) -> List[nn.Module]:
    """Four layers; sizes 70, 88, 45, 18 elements (uneven at W=3, 4).  ``frozen``:
    layer 1's weight is frozen (bias trainable), layer 2 is frozen entirely."""
    torch.manual_seed(0)
    mods: List[nn.Module] = [nn.Sequential(nn.Linear(D_IN, 10), nn.Tanh()), nn.Sequential(nn.Linear(10, 8), nn.Tanh()),
                             nn.Sequential(nn.Linear(8, 5), nn.Tanh()), nn.Linear(5, D_OUT)]
    if frozen:
        mods[1][0].weight.requires_grad_(False)
        for p in mods[2].parameters():
            p.requires_grad_(False)
    return mods


class Block(nn.Module):
    """Residual block: x + W2 tanh(W1 x)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.inner = nn.Linear(d, h)
        self.outer = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class Branchy(nn.Module):
    """An input projection, a LayerNorm, a buffer and a head at the root, residual
    blocks, two parallel branches summed; ``skip=True`` leaves block ``b`` out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Linear(D_IN, 8)
        self.blocks = nn.ModuleList([Block(8, 12), Block(8, 7)])
        self.a = Block(8, 5)
        self.b = Block(8, 9)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, D_OUT)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for blk in self.blocks:
            h = blk(h)
        h = self.a(h) + (0 if skip else self.b(h))
        return self.head(self.norm(h) * self.scale)


class Tfm(nn.Module):
    """torch's TransformerEncoder (its layers reach into ``layers[0].self_attn``:
    attribute access through a Zero3Layer) over length-1 sequences."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.proj = nn.Linear(D_IN, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.proj(x).unsqueeze(1)).squeeze(1))


def build(case: Dict[str, Any], rank: int = 0) -> nn.Module:
    """The unsharded model of a case (rank ``rank``'s, for the mismatch case)."""
    if case["model"] == "branchy":
        return Branchy()
    if case["model"] == "transformer":
        return Tfm()
    mods = stack_modules(frozen=case.get("frozen", False))
    if case.get("mismatch") and rank == 1:
        mods[1] = nn.Sequential(nn.Linear(10, 9), nn.Tanh())
    return nn.Sequential(*mods)


def shard(case: Dict[str, Any], model: nn.Module, rank: int, world: int) -> nn.Module:
    kw = dict(grad_reduce=case.get("grad_reduce", "mean"), compute_dtype=case.get("compute_dtype"))
    if case["model"] == "branchy":
        return zero3(model, wrap={Block}, **kw)
    if case["model"] == "transformer":
        return zero3(model, wrap={nn.TransformerEncoderLayer}, **kw)
    if case.get("labml"):
        return Zero3Sequential([Zero3Layer(m, rank, world, torch.device("cpu"), torch.float32) for m in model])
    return Zero3Sequential([Zero3Layer(m, **kw) for m in model])


def data(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def make_opt(case: Dict[str, Any], params: Any, torch_only: bool = False) -> Any:
    name = case["opt"]
    hp = OPTS[name]
    if torch_only or case.get("impl") == "torch":
        from funcopt.registry import REGISTRY

        return REGISTRY[name].torch_cls(params, **hp)  # torch.optim's class, or the oracle outside torch
    opt = getattr(funcopt, name)(params, **hp)
    return funcopt.script(opt) if case.get("impl") == "scripted" else opt


def _skip(case: Dict[str, Any], step: int) -> Dict[str, Any]:
    return {"skip": True} if case["model"] == "branchy" and case.get("skip") and step % 2 == 1 else {}


# --------------------------------------------------------------- reference
def reference(case: Dict[str, Any]) -> Dict[str, Any]:
    """torch.optim on the unsharded model and the full batch."""
    model = build(case)
    opt = make_opt(case, [p for p in model.parameters() if p.requires_grad], torch_only=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if case.get("sched") else None
    norms = []
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad(set_to_none=not case.get("keep_grad"))
        loss = ((model(x, **_skip(case, step)) - y) ** 2).mean()
        loss.backward()
        if case.get("clip"):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"], case.get("norm_type", 2.0)))
        if not (case.get("found_inf") and step == 1):
            opt.step()
        if sched is not None:
            sched.step()
    out = dict(sd={k: v.clone() for k, v in model.state_dict().items()}, norms=norms)  # eval() below moves them
    if case.get("kind") == "train" and _has_modes(case):
        opt.eval()  # the oracle's eval(): the parameters become the average x
        out["sd_eval"] = model.state_dict()
    return out


# ------------------------------------------------------------ distributed
def train(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    model = shard(case, build(case, rank), rank, world)
    params = model.get_trainable_chunk() if case.get("labml") else model.parameters()
    opt = make_opt(case, params)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if case.get("sched") else None
    n = BATCH // world
    micro = 2 if case.get("accumulate") else 1
    scale = 1024.0 if case.get("found_inf") else 1.0
    norms = []
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad(set_to_none=not case.get("keep_grad"))
        if case.get("no_backward"):  # a forward whose output never gets a backward
            model(x, **_skip(case, step)).sum()
        m = n // micro
        if case.get("double"):  # two forwards, one backward
            h = n // 2
            losses = [((model(x[a:b]) - y[a:b]) ** 2).mean() for a, b in ((0, h), (h, n))]
            ((losses[0] + losses[1]) / 2).backward()
        for k in range(0 if case.get("double") else micro):
            out = model(x[k * m:(k + 1) * m], **_skip(case, step))
            err = ((out.float() - y[k * m:(k + 1) * m]) ** 2)
            if case.get("grad_reduce") == "sum":
                loss = err.sum() / (BATCH * D_OUT)
            else:
                loss = err.mean() / micro
            (loss * scale).backward()
        if case.get("clip"):
            norms.append(model.clip_grad_norm_(case["clip"], case.get("norm_type", 2.0)))
        if case.get("found_inf"):
            opt.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(1.0 if step == 1 else 0.0))
        else:
            opt.step()
        if sched is not None:
            sched.step()
    out = dict(sd=model.full_state_dict(to=0), norms=norms, chunk_numels=[c.numel() for c in model.parameters()])
    if _has_modes(case):  # Schedule-Free: eval() swaps each rank's chunks to x; gathered, x everywhere
        opt.eval()
        out["sd_eval"] = model.full_state_dict(to=0)
    return out


def _has_modes(case: Dict[str, Any]) -> bool:
    return bool(getattr(getattr(funcopt, case["opt"]), "has_modes", False))


def memory_probe(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Bytes held by all original parameters, seen from every inner module in
    forward (pre-hooks) and from inside every inner module in backward (tensor hooks)."""
    model = build(case, rank)
    originals = [p for p in model.parameters()]
    sharded = shard(case, model, rank, world)
    chunks = [(c.name, c.length * c.world * 4) for c in sharded.sharded_chunks()]
    grad_chunks = [c.length * c.world * 4 for c in sharded.sharded_chunks() if c.trainable]
    seen = {"forward": [], "backward": []}
    sched = sharded.schedule
    pending: List[int] = []  # full-size gradient bytes handed over and not yet reduced, inside backward

    def held() -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in originals}
        return sum(storages.values())

    def pre(mod: nn.Module, args: Any) -> None:
        seen["forward"].append(held())

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def bw(g: torch.Tensor) -> None:
                seen["backward"].append(held())
                pending.append(sched.pending_grad_bytes)
            out.register_hook(bw)

    leaves = [m for m in sharded.modules() if not list(m.children()) and not isinstance(m, Zero3Layer)]
    handles = [h for m in leaves for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    opt = funcopt.Adam(sharded.parameters(), lr=0.01)
    n = BATCH // world
    for step in range(2):
        x, y = data(step)
        opt.zero_grad()
        ((sharded(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
        after = dict(held=held(), orig_grads=[p.grad is None for p in originals],
                     chunk_grads=[(c.grad.numel() if c.grad is not None else None, c.numel())
                                  for c in sharded.parameters() if c.requires_grad])
        opt.step()
    for h in handles:
        h.remove()
    with torch.no_grad():  # eval forward: gathers and frees, leaves nothing behind
        sharded.eval()
        out = sharded(data(0)[0])
    eval_state = dict(held=held(), fetched=[m.is_fetched for m in sharded.modules() if isinstance(m, Zero3Layer)],
                      no_grad_fn=out.grad_fn is None)
    return dict(seen=seen, chunks=chunks, grad_chunks=grad_chunks, pending=pending,
                peak_pending=sched.peak_pending_grad_bytes, pending_after=sched.pending_grad_bytes, after=after, eval=eval_state, eval_out=out,
                sd=sharded.full_state_dict(), nbytes=[p.untyped_storage().nbytes() for p in originals])


def load_case(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """load_full_state_dict from rank 1 (or 0): a good dict round-trips, a bad one
    raises DistributedError on every rank and changes nothing."""
    model = shard(case, build(case), rank, world)
    src = 1 if world > 1 else 0
    good = case["state"]
    before = [c.detach().clone() for c in model.parameters()]
    errors = []
    for bad in (dict(list(good.items())[1:]), {**good, next(iter(good)): torch.zeros(1)}):
        try:
            model.load_full_state_dict(bad if rank == src else {}, src=src)
        except DistributedError as e:
            errors.append(str(e))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.load_full_state_dict(good if rank == src else {}, src=src)
    return dict(errors=errors, unchanged=unchanged, sd=model.full_state_dict(to=world - 1),
                sd0=model.full_state_dict(to=0))


def mismatch(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    try:
        shard(case, build(case, rank), rank, world)
    except DistributedError as e:
        return dict(error=str(e))
    return dict(error=None)


def compute_dtype_case(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    model = shard(case, build(case), rank, world)
    gathered = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, a: gathered.append(mod.weight.dtype))
    res = train_with(model, case, rank, world)
    return dict(res, gathered=sorted({str(d) for d in gathered}),
                chunks=[(str(c.dtype), None if c.grad is None else str(c.grad.dtype)) for c in model.parameters()])


def train_with(model: nn.Module, case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    opt = make_opt(case, model.parameters())
    n = BATCH // world
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad(set_to_none=False)
        ((model(x[rank * n:(rank + 1) * n]).float() - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
        opt.step()
    return dict(sd=model.full_state_dict())


RUNNERS = {"train": train, "memory": memory_probe, "load": load_case, "mismatch": mismatch,
           "compute_dtype": compute_dtype_case}


def worker(rank: int, world: int, out_dir: str, cases: List[Dict[str, Any]]) -> None:
    run_cases(rank, out_dir, cases, lambda c: RUNNERS[c["kind"]](c, rank, world))


def train_cases() -> List[Dict[str, Any]]:
    cases = []
    for opt in OPTS:
        # ("torch": torch.optim's own class over the chunks; not an oracle outside torch, e.g. prodigyopt
        # per chunk would estimate d from one rank's elements)
        for impl in ("eager", "scripted", "torch") if hasattr(torch.optim, opt) else ("eager", "scripted"):
            cases.append(dict(kind="train", name=f"stack-{opt}-{impl}", model="stack", opt=opt, impl=impl))
    cases += [
        dict(kind="train", name="branchy-Adam", model="branchy", opt="Adam", impl="eager", skip=True),
        dict(kind="train", name="branchy-skip-keepgrad-AdamW", model="branchy", opt="AdamW", impl="eager", skip=True,
             keep_grad=True),
        dict(kind="train", name="double-forward-SGD", model="stack", opt="SGD", impl="eager", double=True),
        dict(kind="train", name="branchy-SGD-scripted-clip", model="branchy", opt="SGD", impl="scripted", clip=0.3),
        dict(kind="train", name="transformer-SGD-scripted", model="transformer", opt="SGD", impl="scripted"),
        dict(kind="train", name="frozen-AdamW", model="stack", opt="AdamW", impl="eager", frozen=True),
        dict(kind="train", name="frozen-Adagrad-scripted", model="stack", opt="Adagrad", impl="scripted",
             frozen=True),
        dict(kind="train", name="accumulate-Adam", model="stack", opt="Adam", impl="eager", accumulate=True),
        dict(kind="train", name="sum-SGD", model="stack", opt="SGD", impl="eager", grad_reduce="sum"),
        dict(kind="train", name="sum-branchy-Adagrad", model="branchy", opt="Adagrad", impl="eager",
             grad_reduce="sum"),
        dict(kind="train", name="clip2-Adam", model="stack", opt="Adam", impl="eager", clip=0.05),
        dict(kind="train", name="clipinf-SGD-scripted", model="stack", opt="SGD", impl="scripted", clip=0.01,
             norm_type=float("inf")),
        dict(kind="train", name="sched-AdamW-scripted", model="stack", opt="AdamW", impl="scripted", sched=True),
        dict(kind="train", name="scale-inf-Adam-scripted", model="stack", opt="Adam", impl="scripted",
             found_inf=True),
        dict(kind="train", name="no-backward-Adam", model="stack", opt="Adam", impl="eager", no_backward=True),
        dict(kind="train", name="labml-Adam", model="stack", opt="Adam", impl="torch", labml=True),
    ]
    return cases


def other_cases(world: int, state: Dict[str, Any]) -> List[Dict[str, Any]]:
    cases = [dict(kind="memory", name="memory-stack", model="stack"),
             dict(kind="memory", name="memory-branchy", model="branchy"),
             dict(kind="load", name="load-stack", model="stack", state=state["stack"]),
             dict(kind="load", name="load-branchy", model="branchy", state=state["branchy"]),
             dict(kind="compute_dtype", name="bf16-Adam", model="stack", opt="Adam", impl="eager",
                  compute_dtype=torch.bfloat16)]
    if world > 1:
        cases.append(dict(kind="mismatch", name="mismatch", model="stack", mismatch=True))
    return cases


def loadable_states() -> Dict[str, Any]:
    """Full state dicts to load: the unsharded models after a perturbation."""
    out = {}
    for name in ("stack", "branchy"):
        model = build(dict(model=name))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(0.01 * (i + 1))
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(0.5)
        out[name] = copy.deepcopy(model.state_dict())
    return out


def reference_forward(name: str, state: Dict[str, Any]) -> torch.Tensor:
    model = build(dict(model=name))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(data(0)[0])


__all__ = ["BATCH", "Block", "Branchy", "build", "data", "dist", "loadable_states", "other_cases", "reference",
           "reference_forward", "train_cases", "worker"]

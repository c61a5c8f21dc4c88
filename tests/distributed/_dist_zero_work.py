"""What the ranks of tests/distributed/test_zero.py run, and the single-process oracle.

A *case* is a dict describing one training run; :func:`train` runs it the same
way for ``ZeroRedundancyOptimizer`` in the children and for ``torch.optim`` in
the parent, so the only difference between the two is the optimizer (and
where the gradient is averaged).
"""
from __future__ import annotations

import copy
import inspect
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from funcopt.distributed import ZeroRedundancyOptimizer
from funcopt.registry import REGISTRY

from _oracles import other_lr
from _dist_harness import (Net, allreduce_mean_grads, batch, local_slice, run_cases, snapshot)

STEPS, CONT = 10, 3  # steps before consolidating, then steps continued from there

# non-default hyperparameters per algorithm: the registry's configurations
# (rich, and rich with maximize where torch has it)
HYPER = {name: spec.configs() for name, spec in REGISTRY.items()}
# the matrix runs the Net below (matrices and bias vectors): algorithms for
# matrices only (Muon) have their own cases.  The rules beyond torch (issue 23) run their
# oracle classes (cls="torch": ZeRO resolves an oracle class to funcopt's rule) and compare
# consolidated states in the oracle's format (prodigyopt's int step, SOAP's GG/Q lists).
BEYOND_TORCH = {name for name, spec in REGISTRY.items() if spec.oracle_package is not None}
MATRIX_ALGOS = [name for name, spec in REGISTRY.items() if len(spec.probe_shape) < 2]


def _case(name: str, algo: str, **kw: Any) -> Dict[str, Any]:
    c = dict(kind="train", name=name, algo=algo, cls="torch", hyper=HYPER[algo][0], partition="flat",
             bucket_view=False, stage=1, bucket_mb=25, model={}, freeze=(), flip={}, add_group=None,
             steplr=None, groups=False, to=0, torch_continue=True, accum=1)
    c.update(kw)
    return c


def matrix_cases() -> List[Dict[str, Any]]:
    """Every registry algorithm x {flat, greedy} x bucket view on/off (torch and funcopt classes alternate)."""
    out = []
    for algo in MATRIX_ALGOS:
        whole = REGISTRY[algo].whole_params  # never cut: greedy placement only
        for j, (partition, view) in enumerate([("flat", False), ("greedy", False), ("flat", True), ("greedy", True)]):
            if whole and partition == "flat":
                continue
            out.append(_case(f"{algo}-{partition}{'-view' if view else ''}", algo, partition=partition,
                             bucket_view=view, cls="torch" if j in (0, 3) else "funcopt",
                             hyper=HYPER[algo][j % len(HYPER[algo])], groups=(j == 3)))
    return out


def feature_cases() -> List[Dict[str, Any]]:
    return [
        _case("frozen-layer", "Adam", freeze=("l2",)),
        _case("flip-trainable", "SGD", partition="greedy", flip={2: ("l1", False), 5: ("l1", True), 7: ("l3", False)}),
        _case("add-group", "Adam", bucket_view=True, model=dict(extra=True),
              add_group=(3, dict(lr=0.003))),
        _case("add-group-greedy", "AdamW", partition="greedy", model=dict(extra=True),
              add_group=(3, dict(lr=0.02, weight_decay=0.0))),
        _case("steplr", "SGD", steplr=(3, 0.5), torch_continue=False),
        _case("steplr-adam-groups", "Adam", partition="greedy", groups=True, steplr=(4, 0.3), torch_continue=False),
        _case("mixed-dtype", "Adam", model=dict(mixed=True)),
        _case("mixed-dtype-greedy-view", "Adagrad", partition="greedy", bucket_view=True, model=dict(mixed=True)),
        _case("empty-param-flat", "Adam", model=dict(empty=True)),
        _case("empty-param-greedy", "Adam", partition="greedy", model=dict(empty=True)),
        _case("consolidate-to-last", "AdamW", to=-1),
        _case("accumulate", "SGD", accum=2),
        # memory: big enough that padding and per-tensor step counters are noise
        _case("mem-adam-flat", "Adam", model=dict(kind="big"), torch_continue=False),
        _case("mem-sgd-flat", "SGD", model=dict(kind="big"), torch_continue=False),
        _case("mem-adam-greedy", "Adam", partition="greedy", model=dict(kind="big"), torch_continue=False),
    ]


def zero2_cases() -> List[Dict[str, Any]]:
    return [
        _case("z2-adam-flat", "Adam", stage=2),
        _case("z2-sgd-greedy", "SGD", stage=2, partition="greedy", cls="funcopt"),
        _case("z2-adagrad-nobucket", "Adagrad", stage=2, bucket_mb=0),
        _case("z2-adamw-view", "AdamW", stage=2, bucket_view=True),
        _case("z2-mixed", "Adam", stage=2, model=dict(mixed=True)),
        _case("z2-frozen", "Adam", stage=2, freeze=("l1",)),
        _case("z2-flip", "SGD", stage=2, flip={2: ("l1", False), 5: ("l1", True)}),
        _case("z2-add-group", "Adam", stage=2, model=dict(extra=True), add_group=(3, dict(lr=0.003))),
        # two backward calls before each step: the gradients of both must count
        _case("z2-accumulate", "SGD", stage=2, accum=2),
        _case("z2-accumulate-adam-greedy", "Adam", stage=2, partition="greedy", accum=2),
        # ... also when a trainable parameter gets no gradient, so a backward's chunks never all
        # complete (1-element chunks with bucket_size_mb=0: the unused parameter's come last)
        _case("z2-accumulate-unused", "Adagrad", stage=2, bucket_mb=0, accum=2, model=dict(unused=True)),
        # ~198k elements, 1 MiB buckets: several reduce-scatter chunks per space at W=2, 4
        # (SGD: Adam's m/sqrt(v) turns last-bit differences of near-zero gradients into ~1e-5 differences
        # on this model -- DDP + torch.optim.Adam differs from single-process Adam as much)
        _case("z2-wide", "SGD", stage=2, bucket_mb=1, model=dict(kind="wide"), torch_continue=False),
    ]


def train_cases() -> List[Dict[str, Any]]:
    return matrix_cases() + feature_cases() + zero2_cases()


# ----------------------------------------------------------- shared runner
def optimizer_params(case: Dict[str, Any], model: Net) -> Any:
    """What the optimizer is constructed over (the extra layer is added later, if at all)."""
    base = [p for n, p in model.named_parameters() if not n.startswith("extra.")] \
        if case["add_group"] else list(model.parameters())
    if not case["groups"]:
        return base
    first = [model.l1.weight, model.l1.bias, model.l2.weight, model.l2.bias]
    rest = [p for p in base if all(p is not q for q in first)]
    return [dict(params=first), dict(params=rest, lr=other_lr(REGISTRY[case["algo"]], case["hyper"]["lr"]))]


def make_model(case: Dict[str, Any]) -> Net:
    model = Net(**case["model"])
    for name in case["freeze"]:
        getattr(model, name).requires_grad_(False)
    return model


def uses_ddp(case: Dict[str, Any]) -> bool:
    # DDP fixes the set of trainable parameters at construction, so runs that
    # change trainability average gradients by hand; DDP also rejects an
    # empty parameter's bucket.
    return case["stage"] == 1 and not case["flip"] and not case["model"].get("empty") \
        and not case["model"].get("unused")


def apply_events_before(case: Dict[str, Any], model: Net, opt: Any, start: int) -> None:
    """Replay the structural events of steps < start (for runs resumed at ``start``)."""
    for s in sorted(case["flip"]):
        if s < start:
            layer, on = case["flip"][s]
            getattr(model, layer).requires_grad_(on)
    if case["add_group"] and case["add_group"][0] < start:
        opt.add_param_group(dict(case["add_group"][1], params=list(model.extra.parameters())))


def train(case: Dict[str, Any], model: Net, opt: Any, steps: range, rank: int = 0, world: int = 1,
          net: Any = None, reduce: Optional[Callable[[], None]] = None, sched: Any = None,
          after_backward: Optional[Callable[[int], None]] = None, ref_world: int = 1) -> None:
    """``ref_world`` > 1 (single process only): the gradient of each step is
    what ``ref_world`` ranks make of it (each rank's mean-loss gradient over
    its slice of the batch, averaged), not the full batch's.  Mathematically
    the same; in floating point Adam turns the rounding difference of a
    near-zero gradient element into an lr-sized one, so a distributed run is
    compared with the single-process run of the same arithmetic."""
    net = net if net is not None else model
    if ref_world > 1:
        assert world == 1 and reduce is None
    for s in steps:
        if s in case["flip"]:
            layer, on = case["flip"][s]
            getattr(model, layer).requires_grad_(on)
        if case["add_group"] and case["add_group"][0] == s:
            opt.add_param_group(dict(case["add_group"][1], params=list(model.extra.parameters())))
        x, y = batch(s, model)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        if ref_world > 1:
            _ranks_backward(case, model, net, x, y, ref_world)
        else:
            for m in range(case["accum"]):  # gradient accumulation: several backward calls per step
                xm, ym = local_slice(x, m, case["accum"]), local_slice(y, m, case["accum"])
                torch.nn.functional.mse_loss(net(xm), ym).backward()
        if reduce is not None:
            reduce()
        if after_backward is not None:
            after_backward(s)
        opt.step()
        if sched is not None:
            sched.step()


def _ranks_backward(case: Dict[str, Any], model: Net, net: Any, x: torch.Tensor, y: torch.Tensor,
                    world: int) -> None:
    """p.grad += sum over ranks r of (rank r's gradient / world), per micro-batch (DDP's order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for m in range(case["accum"]):
        total: List[Optional[torch.Tensor]] = [None] * len(params)
        for r in range(world):
            xr, yr = local_slice(x, r, world), local_slice(y, r, world)
            xm, ym = local_slice(xr, m, case["accum"]), local_slice(yr, m, case["accum"])
            gs = torch.autograd.grad(torch.nn.functional.mse_loss(net(xm), ym), params, allow_unused=True)
            for i, g in enumerate(gs):
                if g is not None:
                    g = g / world
                    total[i] = g if total[i] is None else total[i] + g
        with torch.no_grad():
            for p, g in zip(params, total):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g


def torch_class(case: Dict[str, Any]) -> type:
    return REGISTRY[case["algo"]].torch_cls


def zero_class(case: Dict[str, Any]) -> type:
    spec = REGISTRY[case["algo"]]
    return spec.torch_cls if case["cls"] == "torch" else spec.cls


def reference(case: Dict[str, Any], world: int = 1) -> Dict[str, Any]:
    """Single process, torch.optim: params and state after STEPS and STEPS+CONT steps; the
    gradients of the full batch, or (``world`` > 1) as ``world`` DDP ranks average them."""
    model = make_model(case)
    # world > 1: the kernel the ranks run too (funcopt's default: torch's fused kernel on the CPU)
    spec = REGISTRY[case["algo"]]
    kernel: Dict[str, Any] = {}
    if world > 1:  # fused where torch has it, else the foreach formula funcopt runs
        accepted = inspect.signature(spec.torch_cls.__init__).parameters
        if "cpu" in spec.fused_devices:
            kernel = dict(fused=True)
        elif "foreach" in accepted:
            kernel = dict(foreach=True)
    opt = torch_class(case)(optimizer_params(case, model), **case["hyper"], **kernel)
    sched = torch.optim.lr_scheduler.StepLR(opt, *case["steplr"]) if case["steplr"] else None
    defaults = inspect.signature(spec.torch_cls.__init__).parameters

    def sd() -> Dict[str, Any]:  # as the user built it: the kernel switch is not part of the comparison
        out = copy.deepcopy(opt.state_dict())
        for g in out["param_groups"]:  # the class's default (torch: None; schedulefree: foreach=True)
            g.update({k: defaults[k].default for k in kernel})
        return out

    train(case, model, opt, range(0, STEPS), sched=sched, ref_world=world)
    out = dict(p10=snapshot(model.parameters()), sd10=sd())
    train(case, model, opt, range(STEPS, STEPS + CONT), sched=sched, ref_world=world)
    out.update(p13=snapshot(model.parameters()), sd13=sd())
    return out


def torch_continue(case: Dict[str, Any], p10: List[torch.Tensor], sd10: Dict[str, Any]) -> List[torch.Tensor]:
    """A plain torch.optim optimizer loads a (consolidated) state dict and trains CONT more steps."""
    model = make_model(case)
    with torch.no_grad():
        for p, v in zip(model.parameters(), p10):
            p.copy_(v)
    opt = torch_class(case)(optimizer_params(case, model), **case["hyper"])
    apply_events_before(case, model, opt, STEPS)
    opt.load_state_dict(copy.deepcopy(sd10))
    train(case, model, opt, range(STEPS, STEPS + CONT))
    return snapshot(model.parameters())


# ------------------------------------------------------------------ children
def _zero(case: Dict[str, Any], params: Any, **over: Any) -> ZeroRedundancyOptimizer:
    kw = dict(partition=case["partition"], parameters_as_bucket_view=case["bucket_view"],
              zero_stage=case["stage"], bucket_size_mb=case["bucket_mb"])
    kw.update(over)
    return ZeroRedundancyOptimizer(params, zero_class(case), **kw, **case["hyper"])


def _setup(case: Dict[str, Any], rank: int, world: int, p_start: Optional[List[torch.Tensor]] = None):
    model = make_model(case)
    if p_start is not None:
        with torch.no_grad():
            for p, v in zip(model.parameters(), p_start):
                p.copy_(v)
    net, reduce = model, None
    if uses_ddp(case):
        net = DDP(model)
    elif case["stage"] == 1:
        def reduce() -> None:
            allreduce_mean_grads(list(model.parameters()))
    opt = _zero(case, optimizer_params(case, model))
    return model, net, reduce, opt


def run_train_case(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    model, net, reduce, opt = _setup(case, rank, world)
    sched = torch.optim.lr_scheduler.StepLR(opt, *case["steplr"]) if case["steplr"] else None
    grad_info: List[Dict[str, Any]] = []

    def after_backward(s: int) -> None:
        if case["stage"] == 2:
            trainable = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
            grad_info.append(dict(step=s, shard_bytes=opt.grad_shard_bytes(),
                                  params=[(p.numel(), p.element_size(), str(p.dtype)) for g in opt.param_groups
                                          for p in g["params"]],
                                  grads_none=[p.grad is None for p in trainable]))

    train(case, model, opt, range(0, STEPS), rank, world, net, reduce, sched, after_backward)
    out: Dict[str, Any] = {}
    if case["stage"] == 2:
        trainable = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        out["after_step"] = dict(shard_bytes=opt.grad_shard_bytes(), grads_none=[p.grad is None for p in trainable])
    to = case["to"] % world
    out["state_bytes"] = opt.state_bytes()
    opt.consolidate_state_dict(to)
    if rank == to:
        out["sd10"] = copy.deepcopy(opt.state_dict())
    else:
        try:
            opt.state_dict()
            out["state_dict_elsewhere"] = None
        except RuntimeError as e:
            out["state_dict_elsewhere"] = str(e)
    out["p10"] = snapshot(model.parameters())
    train(case, model, opt, range(STEPS, STEPS + CONT), rank, world, net, reduce, sched, after_backward)
    opt.consolidate_state_dict(0)
    if rank == 0:
        out["sd13"] = copy.deepcopy(opt.state_dict())
    out["p13"] = snapshot(model.parameters())
    out["grad_info"] = grad_info
    out["lrs"] = [g["lr"] for g in opt.param_groups]
    return out


def run_load_case(case: Dict[str, Any], rank: int, world: int, src: Dict[str, Any]) -> Dict[str, Any]:
    """A ZeRO optimizer at this world size loads a state dict consolidated elsewhere and continues."""
    model, net, reduce, opt = _setup(case, rank, world, p_start=src["p10"])
    apply_events_before(case, model, opt, STEPS)
    opt.load_state_dict(copy.deepcopy(src["sd10"]))
    train(case, model, opt, range(STEPS, STEPS + CONT), rank, world, net, reduce)
    opt.consolidate_state_dict(0)
    out = dict(p13=snapshot(model.parameters()))
    if rank == 0:
        out["sd13"] = copy.deepcopy(opt.state_dict())
    return out


def _catch(fn: Callable[[], Any]) -> Dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        return dict(error=None, type=None, seconds=time.monotonic() - t0)
    except Exception as e:  # the test asserts which type
        return dict(error=str(e), type=type(e).__name__, seconds=time.monotonic() - t0)


def _consolidated(opt: ZeroRedundancyOptimizer) -> Optional[Dict[str, Any]]:
    opt.consolidate_state_dict(0)
    return copy.deepcopy(opt.state_dict()) if dist.get_rank() == 0 else None


def run_bad_load(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Bad state dicts: every rank raises DistributedError, nothing changes."""
    c = _case("bad", "Adam")
    model, net, reduce, opt = _setup(c, rank, world)
    train(c, model, opt, range(0, 3), rank, world, net, reduce)
    box = [_consolidated(opt)]
    dist.broadcast_object_list(box, src=0)
    good = box[0]
    before = dict(sd=copy.deepcopy(good), lrs=[g["lr"] for g in opt.param_groups],
                  params=snapshot(model.parameters()))
    n = len(list(model.parameters()))

    def changed() -> Dict[str, Any]:
        # would change everything if applied: lr, and every state tensor
        sd = copy.deepcopy(good)
        sd["param_groups"][0]["lr"] = 0.5
        for entry in sd["state"].values():
            for k, v in entry.items():
                entry[k] = v * 2 + 1
        return sd

    bad: Dict[str, Dict[str, Any]] = {}
    sd = changed()
    sd["param_groups"] = sd["param_groups"] + [dict(sd["param_groups"][0], params=[])]
    bad["group-count"] = sd
    sd = changed()
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    bad["group-size"] = sd
    # the last parameter belongs to the last rank in the flat partition: only it can see the problem
    sd = changed()
    sd["state"][n - 1]["exp_avg"] = torch.zeros(7)
    bad["shape-last"] = sd
    sd = changed()
    sd["state"][0]["exp_avg_sq"] = torch.zeros(3, 3)
    bad["shape-first"] = sd
    sd = changed()
    del sd["state"][n - 1]["exp_avg_sq"]
    bad["missing-key"] = sd
    sgd = torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9)  # another optimizer's state dict
    for p in sgd.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    sgd.step()
    bad["other-optimizer"] = sgd.state_dict()
    results = {}
    for what, sd in bad.items():
        results[what] = _catch(lambda: opt.load_state_dict(sd))
    after = dict(sd=_consolidated(opt), lrs=[g["lr"] for g in opt.param_groups], params=snapshot(model.parameters()))
    return dict(before=before, after=after, results=results)


def run_mismatch(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Ranks constructing with different parameter sets: DistributedError everywhere, in bounded time."""
    model = Net()
    params = list(model.parameters())
    out = {}
    extra = [torch.nn.Parameter(torch.zeros(4))] if rank == 1 else []
    out["extra-param"] = _catch(lambda: ZeroRedundancyOptimizer(params + extra, torch.optim.Adam, lr=0.01))
    shaped = list(params)
    if rank == world - 1:
        shaped[2] = torch.nn.Parameter(torch.zeros(5, 9))
    out["other-shape"] = _catch(lambda: ZeroRedundancyOptimizer(shaped, torch.optim.SGD, lr=0.1))
    typed = list(params)
    if rank == 0:
        typed[0] = torch.nn.Parameter(params[0].detach().double())
    out["other-dtype"] = _catch(lambda: ZeroRedundancyOptimizer(typed, torch.optim.Adam, lr=0.01))
    other = torch.optim.SGD if rank == world - 1 else torch.optim.Adam
    out["other-class"] = _catch(lambda: ZeroRedundancyOptimizer(params, other, lr=0.01))
    part = "greedy" if rank == 0 else "flat"
    out["other-partition"] = _catch(lambda: ZeroRedundancyOptimizer(params, torch.optim.Adam, partition=part, lr=0.01))
    # the group still works afterwards: a correct construction and a step on every rank
    opt = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    out["afterwards"] = snapshot(params)
    # a mismatch at add_param_group (only rank 0 adds a group)
    extra_p = torch.nn.Parameter(torch.zeros(3))
    if rank == 0:
        out["add-group-one-rank"] = _catch(lambda: opt.add_param_group(dict(params=[extra_p])))
    else:
        out["add-group-one-rank"] = _catch(lambda: opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(4))])))
    out["groups-after-failed-add"] = len(opt.param_groups)
    return out


def run_options(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    params = list(Net().parameters())
    return {
        "overlap_with_ddp+zero_stage=2": _catch(lambda: ZeroRedundancyOptimizer(
            params, torch.optim.Adam, overlap_with_ddp=True, zero_stage=2, lr=0.01)),
        # overlap_with_ddp without its DDP comm hook: step() says to register it
        "overlap_with_ddp-step-without-hook": _catch(lambda: ZeroRedundancyOptimizer(
            params, torch.optim.Adam, overlap_with_ddp=True, lr=0.01).step()),
        "zero_stage=3": _catch(lambda: ZeroRedundancyOptimizer(params, torch.optim.Adam, zero_stage=3, lr=0.01)),
        "zero_stage=0": _catch(lambda: ZeroRedundancyOptimizer(params, torch.optim.Adam, zero_stage=0, lr=0.01)),
        "partition=bogus": _catch(lambda: ZeroRedundancyOptimizer(params, torch.optim.Adam, partition="bogus", lr=0.01)),
        "bad-lr": _catch(lambda: ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=-1.0)),
        # not an optimizer class (a torch.optim class outside the registry runs eagerly: test_zero_compat.py)
        "unknown-class": _catch(lambda: ZeroRedundancyOptimizer(params, dict, lr=0.01)),
    }


# every communication entry point of torch.distributed (counted whatever funcopt builds on)
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list", "gather",
               "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "barrier")


def run_count(case: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """Collectives issued by one ZeRO-2 backward + step with bucket_size_mb=0 (counted at
    torch.distributed, whatever funcopt's internals call)."""
    count = [0]
    saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def counting(fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            count[0] += 1
            return fn(*a, **k)
        return wrapper

    c = _case("count", "Adam", stage=2, bucket_mb=0)
    model, net, reduce, opt = _setup(c, rank, world)
    train(c, model, opt, range(0, 1), rank, world, net, reduce)  # warm-up step
    for n, fn in saved.items():
        setattr(dist, n, counting(fn))
    try:
        train(c, model, opt, range(1, 2), rank, world, net, reduce)
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
    return dict(collectives=count[0], n_params=len(list(model.parameters())),
                n_elements=sum(p.numel() for p in model.parameters()))


ERROR_CASES = [dict(kind="bad_load", name="bad-load"), dict(kind="mismatch", name="mismatch"),
               dict(kind="options", name="options")]


def worker(rank: int, world: int, out_dir: str, cases: List[Dict[str, Any]], sources: Dict[str, Any]) -> None:
    def runner(case: Dict[str, Any]) -> Any:
        kind = case["kind"]
        if kind == "train":
            return run_train_case(case, rank, world)
        if kind == "load":
            return run_load_case(case["case"], rank, world, sources[case["case"]["name"]])
        if kind == "bad_load":
            return run_bad_load(case, rank, world)
        if kind == "mismatch":
            return run_mismatch(case, rank, world)
        if kind == "options":
            return run_options(case, rank, world)
        if kind == "count":
            return run_count(case, rank, world)
        raise AssertionError(kind)

    run_cases(rank, out_dir, cases, runner)

"""One verdict for a hyperparameter value, wherever it enters (issue 19 item 4).

Entry points: the constructor, a ``param_groups`` edit picked up by ``step()``
(eager, and scripted through ``funcopt.script``), ``load_state_dict``, and the
same three under ``ZeroRedundancyOptimizer`` (world size 1, gloo, in this
process).  Algorithms: every registry entry.  Values: odd ones made from each
option's default (a string or ``None`` for a number, a string, ``None``, 2 or
a bool-like 0/1 for a flag, one and three values for a pair, NaN, negative
numbers, tensors, a list for a tuple...).

The oracle is ``torch.optim`` (the registry's ``torch_cls``) run the same way:

* torch refuses the value (its constructor or its steps raise): funcopt raises ``ValueError``/``TypeError``
  naming the key and the value, and the parameters, the state and the other
  hyperparameters are as they were (a refused step stepped nothing);
* torch steps with it: funcopt gives torch's numbers, unless the value is one
  funcopt refuses by a documented verdict (docs/index.md, "Hyperparameters and
  param groups": strings, ``None`` and other non-bool-likes for a flag, a bool
  for a number, NaN, a tensor of more dimensions where torch declares a
  float, a float for an integer), and then it must raise as above.

A value the constructor refuses is refused by every other entry point too
(torch checks values at construction only; funcopt keeps that verdict when
a value arrives later).  ``capturable`` is recorded only by funcopt
(docs/limits.md): where torch's step fails for want of a CUDA device, its
numbers with ``capturable=False`` are the reference.
"""
from __future__ import annotations

import inspect
import math
import os
import tempfile
import warnings
from datetime import timedelta

import pytest
import torch

import funcopt
from _oracles import instance_keys
from funcopt.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPE = (2, 3)
STEPS = 3
ALGORITHMS = list(REGISTRY)
FULL = os.environ.get("FUNCOPT_FULL_GRID", "") not in ("", "0")
# ZeRO entry points: algorithms covering every kind of value (flags, pairs, Adafactor's
# None element, Muon's integer and coded options); FUNCOPT_FULL_GRID=1: all
ZERO_ALGORITHMS = ALGORITHMS if FULL else ["Adam", "Rprop", "Adafactor", "Muon"]


# --------------------------------------------------------------------- values
def _signature(spec):
    """(key, default, annotation) of every option funcopt's and torch's classes share."""
    ours = inspect.signature(spec.cls.__init__).parameters
    theirs = inspect.signature(spec.torch_cls.__init__).parameters
    return [(k, p.default, p.annotation) for k, p in ours.items()
            if k in theirs and k not in ("self", "params", "impl")]


def _torch_declares_tensor(spec, key):
    return "Tensor" in str(inspect.signature(spec.torch_cls.__init__).parameters[key].annotation)


def _odd_values(spec):
    """(key, value) pairs to try, made from each option's default."""
    out = []
    for key, default, annotation in _signature(spec):
        if key in instance_keys(spec) or callable(default):  # funcopt's own keys: the oracle has no verdict
            continue
        base = spec.base.get(key, default)
        if isinstance(default, bool):
            values = ["yes", "no", "", None, 0, 1, 2]
        elif default is None and key in ("foreach", "fused"):
            values = ["yes", 0, 1]
        elif default is None:  # a coded option (Muon's adjust_lr_fn)
            values = ["bogus", ["original"]]
        elif isinstance(default, tuple):
            nums = [j for j, v in enumerate(default) if v is not None]
            values = [default[:1], default + default[-1:], "ab", None, list(default),
                      tuple(math.nan if j in nums else v for j, v in enumerate(default)),
                      tuple(-abs(v) - 0.5 if j in nums else v for j, v in enumerate(default)),
                      tuple(torch.tensor(float(v)) if j in nums else v for j, v in enumerate(default))]
        elif annotation is int:
            values = [2.5, "5", None, True, torch.tensor(2)]
        else:
            values = ["0.1", None, math.nan, -abs(base) - 0.5, True,
                      torch.tensor(float(base)), torch.tensor([float(base)])]
        out += [(key, v) for v in values]
    return out


def _documented_refusal(spec, key, value):
    """Whether funcopt refuses ``value`` for ``key`` by its own verdict even where
    torch.optim steps with it (docs/index.md, "Hyperparameters and param groups")."""
    default = inspect.signature(spec.cls.__init__).parameters[key].default
    annotation = inspect.signature(spec.cls.__init__).parameters[key].annotation

    def bad_number(v, declares_tensor):
        if isinstance(v, bool) or not isinstance(v, (int, float, torch.Tensor)):
            return True
        if isinstance(v, torch.Tensor) and v.dim() > 0 and not declares_tensor:
            return True
        return math.isnan(float(v))

    if isinstance(default, bool):
        if isinstance(value, bool):
            return False
        return key == "differentiable" or not (type(value) is int and value in (0, 1))
    if default is None and key in ("foreach", "fused"):
        return not (value is None or isinstance(value, bool) or (type(value) is int and value in (0, 1)))
    if default is None:
        return False  # coded options: torch's verdict (plus the kernel's codes)
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(default):
            return True
        return any(not (v is None and d is None) and bad_number(v, _torch_declares_tensor(spec, key))
                   for v, d in zip(value, default))
    if annotation is int:
        return isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and value.is_floating_point())
    return bad_number(value, _torch_declares_tensor(spec, key))


def _label(key, value):
    return f"{key}={value!r}"


# ------------------------------------------------------------------ the runs
def _param():
    return torch.linspace(-1.0, 1.0, 6).reshape(SHAPE).requires_grad_()


def _grad(t):
    return torch.linspace(0.5, -0.3, 6).reshape(SHAPE) * (1.0 + 0.25 * t)


def _step(opt, p, t):
    p.grad = _grad(t)
    opt.step()


def _snapshot(opt, params):
    sd = opt.state_dict()
    state = {i: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
             for i, e in sd["state"].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [p.detach().clone() for p in params], state, groups


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, equal_nan=True, rtol=0, atol=0)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _unchanged(before, after, skip_key=None):
    """Problems between two snapshots (params, state, hyperparameters but ``skip_key``)."""
    problems = []
    (p0, s0, g0), (p1, s1, g1) = before, after
    if not all(torch.equal(a, b) for a, b in zip(p0, p1)):
        problems.append("parameters changed")
    if s0.keys() != s1.keys() or any(e.keys() != s1[i].keys() or not all(_same(v, s1[i][k]) for k, v in e.items())
                                     for i, e in s0.items()):
        problems.append("state changed")
    for a, b in zip(g0, g1):
        for k in set(a) | set(b):
            if k != skip_key and not _same(a.get(k, "<missing>"), b.get(k, "<missing>")):
                problems.append(f"param_groups[{k!r}] changed: {a.get(k, '<missing>')!r} -> {b.get(k, '<missing>')!r}")
    return problems


def _torch_run(spec, key, value, entry, capturable_off=False):
    """torch.optim run as ``entry`` enters the value; returns the parameter after
    STEPS steps, or raises what torch raised."""
    v = False if capturable_off else value
    p = _param()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if entry == "ctor":
            opt = spec.torch_cls([p], **dict(spec.base, **{key: v}))
            for t in range(STEPS):
                _step(opt, p, t)
        else:
            opt = spec.torch_cls([p], **spec.base)
            _step(opt, p, 0)
            if entry == "edit":
                opt.param_groups[0][key] = v
            else:
                sd = opt.state_dict()
                sd["param_groups"][0][key] = v
                opt.load_state_dict(sd)
            for t in range(1, STEPS):
                _step(opt, p, t)
    return p.detach()


def _oracle(spec, key, value, entry):
    """('ok', parameter) or ('refused', why): torch's verdict for ``value`` entering as ``entry``.
    A value torch's constructor refuses is refused whatever the entry (one verdict)."""
    outcome = None
    for e in (("ctor",) if entry == "ctor" else ("ctor", entry)):
        try:
            got = _torch_run(spec, key, value, e)
        except AssertionError as err:  # capturable=True on CPU: recorded only by funcopt
            if key != "capturable" or "capturable" not in str(err):
                return "refused", f"{type(err).__name__}: {err}"
            got = _torch_run(spec, key, value, e, capturable_off=True)
        except Exception as err:
            return "refused", f"{type(err).__name__}: {err}"
        outcome = got
    return "ok", outcome


def _judge(spec, key, value, entry, run):
    """Run funcopt's ``run()`` -> (parameter, before, after snapshots or None) and
    compare with the oracle; returns a list of problems (empty: fine)."""
    verdict, ref = _oracle(spec, key, value, entry)
    must_refuse = verdict == "refused" or _documented_refusal(spec, key, value)
    label = f"{spec.name} {entry} {_label(key, value)}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = run()
    except (ValueError, TypeError) as err:
        problems = []
        if not must_refuse:
            problems.append(f"{label}: refused ({type(err).__name__}: {err}) but torch steps with it")
        msg = str(err)
        if key not in msg:
            problems.append(f"{label}: the message does not name {key!r}: {msg}")
        if not isinstance(value, torch.Tensor) and repr(value) not in msg:
            problems.append(f"{label}: the message does not show the value {value!r}: {msg}")
        changed = getattr(err, "_unchanged_problems", [])
        problems += [f"{label}: {c}" for c in changed]
        return problems
    except Exception as err:
        return [f"{label}: {type(err).__name__} (expected ValueError/TypeError or success): {err}"]
    if must_refuse:
        why = ref if verdict == "refused" else "funcopt's documented verdict"
        return [f"{label}: accepted, but must be refused ({why})"]
    if not torch.allclose(p, ref, rtol=1e-5, atol=1e-6, equal_nan=True):  # a diverging value: both diverge
        return [f"{label}: accepted, but not torch's numbers: {p.flatten().tolist()} vs {ref.flatten().tolist()}"]
    return []


def _guard(opt, params, skip_key, action):
    """Run ``action``; if it raises ValueError/TypeError, attach what changed since before."""
    before = _snapshot(opt, params)
    try:
        action()
    except (ValueError, TypeError) as err:
        err._unchanged_problems = _unchanged(before, _snapshot(opt, params), skip_key)
        raise


# ------------------------------------------------------------------ funcopt
def _funcopt_run(spec, key, value, entry, make=None):
    """funcopt's run of ``entry``; ``make(params, **kw)`` builds the optimizer
    (default: the funcopt class; ZeRO passes its own)."""
    make = make or (lambda params, **kw: spec.cls(params, **kw))

    def run():
        p = _param()
        if entry == "ctor":
            start = p.detach().clone()
            try:
                opt = make([p], **dict(spec.base, **{key: value}))
            except (ValueError, TypeError) as err:
                err._unchanged_problems = [] if torch.equal(p.detach(), start) else ["parameters changed"]
                raise
            for t in range(STEPS):
                _step(opt, p, t)
            return p.detach()
        opt = make([p], **spec.base)
        _step(opt, p, 0)
        if entry in ("edit", "scripted"):
            if entry == "scripted":
                opt = funcopt.script(opt)

            def edit_and_step():
                opt.param_groups[0][key] = value
                _step(opt, p, 1)

            _guard(opt, [p], key, edit_and_step)
        else:
            sd = opt.state_dict()
            sd["param_groups"][0] = dict(sd["param_groups"][0], **{key: value})
            _guard(opt, [p], None, lambda: opt.load_state_dict(sd))
            _step(opt, p, 1)
        for t in range(2, STEPS):
            _step(opt, p, t)
        return p.detach()

    return run


def _check(spec, entry, make=None, values=None):
    problems = []
    oracle_entry = "edit" if entry == "scripted" else entry
    for key, value in values if values is not None else _odd_values(spec):
        run = _funcopt_run(spec, key, value, entry, make)
        problems += _judge(spec, key, value, oracle_entry, run)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("entry", ["ctor", "edit", "load"])
def test_one_verdict_eager(name, entry):
    _check(REGISTRY[name], entry)


def _scripted_values(spec):
    """Scripted steps: one value of each sort (a string and a bool-like int for a flag,
    one and three values and a list for a pair, NaN and a 0-d tensor for a number)."""
    keep = []
    for key, value in _odd_values(spec):
        if isinstance(value, str) and value not in ("yes",):
            continue
        if value is None or value in ([],) or isinstance(value, bool):
            continue
        keep.append((key, value))
    return keep


# The default tier runs a sample of the values ("sample"); FUNCOPT_FULL_GRID=1 adds
# the others ("rest") under their own test ids, so the rest tier (which deselects
# every id the default tier runs, tests/conftest.py) runs exactly the others.
PARTS = ["sample", "rest"] if FULL else ["sample"]


def _part(values, part, offset=0):
    picked = set(range(offset, len(values), 3))
    return [v for i, v in enumerate(values) if (i in picked) == (part == "sample")]


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_one_verdict_scripted_step(name, part):
    """A ``param_groups`` edit picked up by a scripted optimizer's step."""
    from funcopt._compat import scripting_unavailable

    if scripting_unavailable() is not None:
        pytest.skip(scripting_unavailable())
    _check(REGISTRY[name], "scripted", values=_part(_scripted_values(REGISTRY[name]), part))


# --------------------------------------------------------------------- ZeRO
@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        try:
            yield
        finally:
            dist.destroy_process_group()


def _zero_maker(spec):
    from funcopt.distributed import ZeroRedundancyOptimizer

    return lambda params, **kw: ZeroRedundancyOptimizer(params, spec.cls, **kw)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("name", ZERO_ALGORITHMS)
@pytest.mark.parametrize("entry", ["ctor", "edit", "load"])
def test_one_verdict_zero(world_of_one, name, entry, part):
    spec = REGISTRY[name]
    # every third value (a ZeRO step scripts its local optimizer: ~50 ms a case); FULL: all
    values = _part(_odd_values(spec), part, entry_offset(entry))
    _check(spec, entry, make=_zero_maker(spec), values=values)


def entry_offset(entry):
    """Each entry point its own third of the values, so the three together try them all."""
    return ["ctor", "edit", "load"].index(entry)


# ------------------------------------------------------------ a few by hand
def test_the_cases_the_issue_names():
    """The three inconsistencies issue 19 found, each now one verdict at every entry point."""
    for entry in ("ctor", "edit", "scripted", "load"):
        for key, value, err in (("amsgrad", "yes", TypeError), ("maximize", "no", TypeError),
                                ("betas", (0.9,), ValueError), ("betas", (0.9, 0.99, 0.999), ValueError)):
            run = _funcopt_run(REGISTRY["Adam"], key, value, entry)
            with pytest.raises(err, match=key) as e:
                run()
            assert not getattr(e.value, "_unchanged_problems", []), (entry, key, e.value._unchanged_problems)


def test_bool_like_int_flag_gives_torch_numbers():
    """amsgrad=1 / maximize=1 are accepted everywhere (torch steps them as True)."""
    for key in ("amsgrad", "maximize"):
        run = _funcopt_run(REGISTRY["Adam"], key, 1, "ctor")
        torch.testing.assert_close(run(), _torch_run(REGISTRY["Adam"], key, True, "ctor"))


def test_a_group_without_gradients_keeps_torchs_leniency():
    """A refused value in a group none of whose parameters has a gradient does not stop
    the step of the others (torch reads a group's values only when it steps it); the
    value is refused when that group steps."""
    a, b = _param(), _param()
    opt = funcopt.Adam([{"params": [a]}, {"params": [b]}], lr=0.1)
    opt.param_groups[1]["amsgrad"] = "yes"
    opt.step([_grad(0), None])
    assert not torch.equal(a.detach(), _param().detach())
    with pytest.raises(TypeError, match="amsgrad"):
        opt.step([_grad(1), _grad(1)])

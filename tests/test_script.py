"""TorchScript paths compared with eager, by value.

* A whole training step (forward, ``torch.autograd.grad``, funcopt step) in a
  scripted module, saved with ``torch.jit.save`` and trained on in a fresh
  process that never imports funcopt, equals the same steps run eagerly
  (an algorithm whose torch class refuses the net's bias vectors -- Muon,
  matrices only -- optimizes the parameters it takes: ``spec.takes``).
* ``funcopt.script(opt)`` equals the eager optimizer for every registry
  algorithm over the pairwise cover of its grid (``spec.pairs()``), both
  impls, with ``None`` grads.
* Regressions for the two TorchScript pitfalls documented in
  ``funcopt/_slots.py`` and ``funcopt/optimizers/_common.py`` (dead-code
  elimination of in-place ops on fresh lists; CSE merging state allocations).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Optional

import pytest
import torch

import funcopt
from funcopt import registry
from _oracles import same_value
from _selection import selected
from funcopt.registry import REGISTRY
from funcopt.script import quiet_jit

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMPLS = ("foreach", "fused")


def _impls(spec):
    """``fused`` only where torch has a fused CPU kernel for the algorithm."""
    return [i for i in IMPLS if i != "fused" or "cpu" in spec.fused_devices]
N_STEPS = 10


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "train_step_script", ROOT / "examples" / "train_step_script.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


example = _load_example()


def _module_cases() -> Dict[str, Any]:
    """name -> (class, hyperparameters, impl): each algorithm's registry base,
    plus variants with more state (SGD momentum, Adam amsgrad)."""
    variants: List[Any] = []
    for name, spec in REGISTRY.items():
        variants.append((name, spec.cls, dict(spec.base)))
    if "SGD" in REGISTRY:
        variants.append(("SGD-nesterov", REGISTRY["SGD"].cls, dict(REGISTRY["SGD"].base, momentum=0.9, nesterov=True)))
    if "Adam" in REGISTRY:
        variants.append(("Adam-amsgrad", REGISTRY["Adam"].cls, dict(REGISTRY["Adam"].base, amsgrad=True)))
    return {f"{n}-{impl}": (cls, kw, impl) for n, cls, kw in variants for impl in _impls(registry.get(cls))}


MODULE_CASES = _module_cases()


def _taken(case: str, params) -> List[int]:
    """Indices of the ``params`` that the case's algorithm takes
    (``spec.takes``): all of them, except where torch's class refuses some."""
    spec = registry.get(MODULE_CASES[case][0])
    return [i for i, p in enumerate(params) if spec.takes(tuple(p.shape), p.dtype)]


def _build(case: str, keep: Optional[list] = None) -> torch.nn.Module:
    """The example's TrainStep for ``case``.  Where the algorithm's torch class
    refuses some of the Linear/ReLU net's parameters (Muon: matrices only, not
    the bias vectors), the module optimizes only the parameters it takes
    (``spec.takes``, via :func:`_taken`): ``m.params`` -- what ``train_step``
    differentiates and steps -- holds those, the others stay as initialized.
    Every other algorithm optimizes all of them, as the example does."""
    cls, kw, impl = MODULE_CASES[case]
    taken: List[torch.Tensor] = []

    def make(ps):
        taken.extend(ps[i] for i in _taken(case, ps))
        opt = cls(taken, impl=impl, **kw)
        if keep is not None:
            keep.append(opt)
        return opt

    torch.manual_seed(0)
    m = example.TrainStep(make)
    m.params = taken  # the same tensor objects as the net's parameters
    return m


def _eager_params(case: str, x: torch.Tensor, y: torch.Tensor) -> List[torch.Tensor]:
    """The reference: the same module, the eager funcopt optimizer (Python wrapper).

    Bitwise equality with the scripted module also needs TorchScript's own
    forward/backward to round like eager autograd.  It does for the example's
    Linear/ReLU/MSE net under the default (profiling) executor; with ``Tanh``
    it does not: from the second call the executor's symbolic autodiff
    computes tanh's backward with other ops and the gradients differ by an
    ulp (torch behaviour, unrelated to the optimizer).
    """
    keep: list = []
    m = _build(case, keep)
    opt = keep[0]
    params = list(m.params)  # the parameters the optimizer holds (_build)
    for _ in range(N_STEPS):
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.step(list(torch.autograd.grad(loss, params)))
    return [p.detach().clone() for p in m.net.parameters()]


CHILD = textwrap.dedent(
    """
    import sys

    class _NoFuncopt:  # the editable install would otherwise make funcopt importable
        def find_spec(self, name, path=None, target=None):
            if name == "funcopt" or name.startswith("funcopt."):
                raise ImportError("funcopt must not be imported here")
            return None

    sys.meta_path.insert(0, _NoFuncopt())
    import warnings
    # torch's TorchScript notice only (DeprecationWarning on 2.13, FutureWarning
    # from 2.14; the same pattern as funcopt._compat, which this child may not import)
    warnings.filterwarnings("ignore", message=r"`torch\\.jit\\.\\w+` is deprecated", module=r"torch\\.jit")
    import torch

    # each argument: NAME=I,J,...: the indices of the net's parameters the
    # optimizer holds (all of them but for an algorithm that refuses some)
    cases = [(a.split("=")[0], [int(i) for i in a.split("=")[1].split(",")]) for a in sys.argv[2:]]
    x, y = torch.load("data.pt")
    out = {}
    for name, idx in cases:
        m = torch.jit.load(name + ".pt")
        net = [p.data_ptr() for p in m.net.parameters()]
        assert [p.data_ptr() for p in m.params] == [net[i] for i in idx], "params attribute lost its aliasing"
        before = [p.detach().clone() for p in m.net.parameters()]
        losses = [m.train_step(x, y) for _ in range(%d)]
        after = [p.detach().clone() for p in m.net.parameters()]
        for i, (a, b) in enumerate(zip(before, after)):
            # the optimized parameters move, the others (if any) do not
            assert torch.equal(a, b) == (i not in idx), name + ": param %%d moved=%%s" %% (i, not torch.equal(a, b))
        out[name] = after
    torch.save(out, sys.argv[1])
    assert "funcopt" not in sys.modules
    print("child ok", len(out))
    """
    % N_STEPS
)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)


@pytest.fixture(scope="module")
def child_results(tmp_path_factory, data, request):
    """Script + save every case this run selected (its tier, ``-k``), then train them in
    fresh processes (two, half each)."""
    d = tmp_path_factory.mktemp("jit")
    torch.save(data, d / "data.pt")
    chosen = selected(request, "test_saved_module_trains_without_funcopt", "case")
    args = []
    for case in [c for c in MODULE_CASES if c in chosen]:
        m = _build(case)
        args.append(case + "=" + ",".join(map(str, _taken(case, list(m.net.parameters())))))
        with quiet_jit():
            torch.jit.save(torch.jit.script(m), str(d / f"{case}.pt"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # two fresh processes, each training half of the cases (the 2-core machine: the
    # executor's first calls of each loaded module dominate, one core per process)
    halves = [half for half in (args[0::2], args[1::2]) if half]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, f"result{i}.pt", *half], cwd=d, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, half in enumerate(halves)]
    out = {}
    for i, proc in enumerate(procs):
        try:
            so, se = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, so + se
        out.update(torch.load(d / f"result{i}.pt"))
    return out


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_saved_module_trains_without_funcopt(case, child_results, data):
    want = _eager_params(case, *data)
    got = child_results[case]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_scripted_module_in_process(case, data):
    x, y = data
    with quiet_jit():
        m = torch.jit.script(_build(case))
    net = [p.data_ptr() for p in m.net.parameters()]
    assert [p.data_ptr() for p in m.params] == [net[i] for i in _taken(case, list(m.net.parameters()))]
    for _ in range(N_STEPS):
        m.train_step(x, y)
    for g, w in zip(m.net.parameters(), _eager_params(case, x, y)):
        assert torch.equal(g, w)


def test_example_script_runs(tmp_path):
    example.main(["--steps", "3", "--out", str(tmp_path / "ts.pt")])
    assert (tmp_path / "ts.pt").exists()


# ---------------------------------------------------------------------------
# funcopt.script(opt) vs eager: every registry algorithm, pairwise grid, both impls

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,), (1,)]
# which gradients are present at each step: late first gradients, subsets, gaps
PATTERN = [
    [1, 1, 0, 1, 0],
    [1, 0, 1, 1, 0],
    [1, 1, 1, 1, 1],
    [0, 1, 0, 0, 1],
    [1, 1, 1, 1, 1],
]


def _shapes(spec) -> List[tuple]:
    """SHAPES as the algorithm's torch class takes them (``spec.param_shape``:
    unchanged but for Muon, matrices only)."""
    return [spec.param_shape(s) for s in SHAPES]


def _params(seed: int = 0, shapes=SHAPES) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(step: int, shapes=SHAPES) -> List[Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) if on else None for s, on in zip(shapes, PATTERN[step])]


def _run(opt, params) -> None:
    shapes = [tuple(p.shape) for p in params]
    for k in range(len(PATTERN)):
        opt.step(_grads(k, shapes))


def _assert_same(a_opt, a_params, b_opt, b_params) -> None:
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
    sa, sb = a_opt.state_dict()["state"], b_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert same_value(sa[i][k], sb[i][k]), (i, k)  # (SOAP: lists of tensors, numbers)


# the pairwise cover of each grid (every value of every option and every pair
# of values; FUNCOPT_FULL_GRID=1: every point): scripting costs ~10x an eager
# step, and every point is compared with torch eagerly in tests/test_parity.py
ALL_COMBOS = [
    pytest.param(name, kw, impl, id=f"{name}-{impl}-{j}")
    for name, spec in REGISTRY.items()
    for j, kw in enumerate(spec.combos()) if kw in spec.pairs()
    for impl in _impls(spec)
]


@pytest.mark.parametrize("name,kw,impl", ALL_COMBOS)
def test_script_matches_eager(name, kw, impl):
    cls, shapes = REGISTRY[name].cls, _shapes(REGISTRY[name])
    pe, ps = _params(shapes=shapes), _params(shapes=shapes)
    eager = cls(pe, impl=impl, **kw)
    scripted = funcopt.script(cls(ps, impl=impl, **kw))
    assert isinstance(scripted.core, torch.jit.RecursiveScriptClass)
    _run(eager, pe)
    _run(scripted, ps)
    _assert_same(eager, pe, scripted, ps)


# ---------------------------------------------------------------------------
# regressions for the TorchScript pitfalls


@pytest.mark.parametrize("name,impl", [(n, i) for n, s in REGISTRY.items() for i in _impls(s)])
def test_dce_subset_step_updates_params(name, impl):
    """A step over a subset of the parameters builds fresh lists for the
    kernel; the script compiler must not drop the in-place update."""
    cls, kw, shapes = REGISTRY[name].cls, REGISTRY[name].base, _shapes(REGISTRY[name])
    pe, ps = _params(shapes=shapes), _params(shapes=shapes)
    start = [p.detach().clone() for p in ps]
    eager = cls(pe, impl=impl, **kw)
    scripted = funcopt.script(cls(ps, impl=impl, **kw))
    subset = [torch.ones(s) if i % 2 == 0 else None for i, s in enumerate(shapes)]
    full = [torch.full(s, 0.5) for s in shapes]
    for grads in (subset, full, subset):  # subset before and after every param has state
        eager.step(grads)
        scripted.step(grads)
        for i, (p, q) in enumerate(zip(pe, ps)):
            assert torch.equal(p, q), i
    for i, (p, p0) in enumerate(zip(ps, start)):
        assert not torch.equal(p, p0), f"param {i} was never updated"


@pytest.mark.parametrize("impl", IMPLS)
def test_cse_state_tensors_are_distinct(impl):
    """First scripted Adam step: exp_avg and exp_avg_sq are separate tensors
    (not merged by common-subexpression elimination) with torch.optim's values."""
    ps, pt = _params(), _params()
    opt = funcopt.script(funcopt.Adam(ps, lr=0.01, amsgrad=True, impl=impl))
    ref = torch.optim.Adam(pt, lr=0.01, amsgrad=True, **{impl: True})
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(7)) for s in SHAPES]
    opt.step(grads)
    for p, g in zip(pt, grads):
        p.grad = g.clone()
    ref.step()
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    ptrs = set()
    for i in range(len(SHAPES)):
        st = ours[i]
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert st[k].data_ptr() not in ptrs, (i, k)
            ptrs.add(st[k].data_ptr())
            assert torch.equal(st[k], theirs[i][k]), (i, k)
        assert not torch.equal(st["exp_avg"], st["exp_avg_sq"])
        assert torch.equal(ps[i], pt[i])

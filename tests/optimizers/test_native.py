"""The native one-pass rules (funcopt/optimizers/<name>.cpp, funcopt.native).

Every registry algorithm with a native rule, over its pairwise grid
(``spec.pairs()``), float32 and float64, eager and scripted, 20 steps with
``None`` gradients, against the oracle ``torch.optim.<Name>(foreach=True)``:
close to the tolerance torch's own fused-vs-foreach tests use (torch's CPU
``sqrt`` is not correctly rounded, so the last bit of some elements differs),
(``impl="foreach"``, the path every native algorithm falls back to, is
tests/test_parity.py's: bitwise equal to torch).  Then the op's own contract (checks before changes,
version counters, AMP), the fallbacks (``FUNCOPT_NATIVE=0``, no compiler),
embedding (``opt.core`` saves ATen ops only; ``opt.step_core`` needs the
library, loaded with one line) and ``torch.compile``.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import funcopt
from funcopt import native
from funcopt.registry import REGISTRY
from funcopt.script import quiet_jit

NATIVE = {name: spec for name, spec in REGISTRY.items() if spec.native_rule}
STEPS = 20
# torch.testing.assert_close's defaults, which torch's fused-vs-foreach optimizer tests use
TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.float64: dict(rtol=1e-7, atol=1e-7)}

pytestmark = pytest.mark.skipif(not native.available(), reason="funcopt's native kernels could not be built "
                                f"here (no working C++ compiler): {native.status()['error']}")


def _params(spec, dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (), (2, 2, 2), (0,), (1000,)]
    return [torch.randn(spec.param_shape(s), dtype=dtype, generator=g) for s in shapes]


def _grads(params, step, gen):
    gs = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    if step in (0, 4):
        gs[1] = None
    if step == 9:
        gs[3] = None
    return gs


def _run(spec, kw, dtype, impl, scripted=False):
    """funcopt (impl) and torch.optim(foreach=True) over the same gradients."""
    init = _params(spec, dtype)
    fp = [p.clone().requires_grad_() for p in init]
    tp = [p.clone().requires_grad_() for p in init]
    fo = spec.cls(fp, impl=impl, **kw)
    if scripted:
        funcopt.script(fo)
    to = spec.torch_cls(tp, **spec.torch_flags(dict(kw, foreach=True)))
    gen = torch.Generator().manual_seed(1)
    for t in range(STEPS):
        gs = _grads(init, t, gen)
        fo.step(gs)
        for p, g in zip(tp, gs):
            p.grad = None if g is None else g.clone()
        to.step()
    return fo, to, fp, tp


def _compare(fo, to, fp, tp, exact, what):
    for i, (a, b) in enumerate(zip(fp, tp)):
        if exact:
            assert torch.equal(a, b), f"{what}: param {i}"
        else:
            torch.testing.assert_close(a, b, **TOL[a.dtype], msg=lambda m: f"{what}: param {i}: {m}")
    fs, ts = fo.state_dict(), to.state_dict()
    strip = lambda groups: [{k: v for k, v in g.items() if k != "foreach"} for g in groups]  # noqa: E731
    assert strip(fs["param_groups"]) == strip(ts["param_groups"]), what
    assert fs["state"].keys() == ts["state"].keys(), what
    for i, entry in ts["state"].items():
        assert fs["state"][i].keys() == entry.keys(), (what, i)
        for k, v in entry.items():
            got = fs["state"][i][k]
            assert got.dtype == v.dtype and got.shape == v.shape, (what, i, k)
            if exact or k == "step":
                assert torch.equal(got, v), (what, i, k)
            else:
                torch.testing.assert_close(got, v, **TOL[v.dtype], msg=lambda m: f"{what}: state {i} {k}: {m}")


def _cases():
    """float32 over the pairwise cover of the grid; float64 (the rule is a
    template over the dtype: one more instantiation) over the cover's first
    half.  impl='foreach' -- the path every native algorithm falls back to --
    is tests/test_parity.py's, bitwise against torch for every grid point."""
    for name, spec in NATIVE.items():
        pairs = spec.pairs()
        for j, kw in enumerate(pairs):
            yield pytest.param(name, kw, torch.float32, id=f"{name}-{j}-f32")
            if j < (len(pairs) + 1) // 2:
                yield pytest.param(name, kw, torch.float64, id=f"{name}-{j}-f64")


@pytest.mark.parametrize("name,kw,dtype", list(_cases()))
def test_native_matches_torch_foreach(name, kw, dtype):
    spec = NATIVE[name]
    fo, to, fp, tp = _run(spec, kw, dtype, "auto")
    assert fo.uses_native, f"{name}: the native rule did not run"
    _compare(fo, to, fp, tp, exact=False, what=f"{name} native {kw}")


# rules with no sqrt: torch's own CPU roundings throughout (funcopt's add_alpha, lerp, addcmul)
BITWISE = ("SGD", "ASGD", "Rprop", "Lion", "Adamax")


@pytest.mark.parametrize("name,kw,dtype", [c for c in _cases() if c.values[0] in BITWISE])
def test_native_bitwise_where_no_sqrt(name, kw, dtype):
    """SGD (momentum, dampening, Nesterov, weight decay, maximize, the first
    step's buffer = the gradient), ASGD, Rprop, Lion and Adamax: bitwise
    torch.optim's foreach step, parameters and state."""
    spec = NATIVE[name]
    fo, to, fp, tp = _run(spec, kw, dtype, "auto")
    assert fo.uses_native
    _compare(fo, to, fp, tp, exact=True, what=f"{name} native {kw}")


@pytest.mark.parametrize("name", list(NATIVE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_scripted_native_equals_eager_native(name, dtype):
    """The scripted step calls the same op: bitwise the eager native step."""
    spec = NATIVE[name]
    ea, _, efp, _ = _run(spec, spec.rich, dtype, "auto")
    sc, to, sfp, tp = _run(spec, spec.rich, dtype, "auto", scripted=True)
    assert sc.uses_native
    for a, b in zip(efp, sfp):
        assert torch.equal(a, b)
    _compare(sc, to, sfp, tp, exact=False, what=f"{name} scripted native")


def test_parallel_for_runs_on_every_intra_op_thread():
    """The library's ``at::parallel_for`` really forks: with two intra-op threads a
    two-part loop runs on two threads (a build without ``-fopenmp`` ran every rule on
    the calling thread alone, whatever ``torch.set_num_threads`` said)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.funcopt.parallel_width(2) == 2
        torch.set_num_threads(1)
        assert torch.ops.funcopt.parallel_width(2) == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_one_openmp_runtime_in_the_process():
    """The library links the OpenMP runtime file torch ships (``native._openmp``), never a
    second one beside it (two GNU OpenMP runtimes in a process give wrong thread numbers)."""
    import re

    native.load()
    with open("/proc/self/maps") as f:
        gomp = {m for m in re.findall(r"\S*libgomp\S*", f.read())}
    assert len(gomp) <= 1, gomp
    if native.LDFLAGS:
        assert {os.path.realpath(p) for p in gomp} == {os.path.realpath(native.LDFLAGS[0])}


@pytest.mark.parametrize("name", list(NATIVE))
def test_one_parallel_for_splits_without_changing_numbers(name):
    """With two intra-op threads a step is one ``at::parallel_for`` over every
    tensor's elements (one part per thread, cut inside a tensor at a multiple
    of 64 elements, many small tensors batched): bitwise the one-thread step,
    whatever the sizes (empty, tiny, odd, one large tensor cut in two)."""
    spec = NATIVE[name]
    g = torch.Generator().manual_seed(0)
    shapes = [(70001,), (3,), (0,), (40000,), ()] + [(1000,)] * 30 + [(257, 129)]
    init = [torch.randn(spec.param_shape(s), generator=g) for s in shapes]
    grads = [[torch.randn(p.shape, generator=g) for p in init] for _ in range(3)]
    out = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ps = [p.clone() for p in init]
            opt = spec.cls(ps, **spec.rich)
            assert opt.uses_native
            for gs in grads:
                opt.step(gs)
            out.append((ps, opt.state_dict()["state"]))
    finally:
        torch.set_num_threads(threads)
    (a, sa), (b, sb) = out
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for i, entry in sa.items():
        for k, v in entry.items():
            assert torch.equal(v, sb[i][k]), (i, k)


@pytest.mark.parametrize("name", list(NATIVE))
def test_strided_and_odd_tensors_are_routed(name):
    """A transposed parameter and an expanded gradient take the foreach
    formula; the contiguous ones the native rule; all close to torch."""
    spec = NATIVE[name]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(spec.param_shape((64, 32)), generator=g).t(), torch.randn(spec.param_shape((300,)), generator=g)]
    fp = [b.clone().requires_grad_() if b.is_contiguous() else b.clone().t().contiguous().t().requires_grad_()
          for b in base]
    tp = [b.detach().clone().requires_grad_() for b in fp]
    assert not fp[0].is_contiguous()
    fo = spec.cls(fp, **spec.rich)
    to = spec.torch_cls(tp, **spec.torch_flags(dict(spec.rich, foreach=True)))
    for t in range(5):
        gs = [torch.randn(p.shape, generator=g) for p in fp]
        gs[1] = torch.randn(1, generator=g).expand(fp[1].shape)  # stride 0
        fo.step(gs)
        for p, gr in zip(tp, gs):
            p.grad = gr.clone()
        to.step()
    assert fo.uses_native
    for a, b in zip(fp, tp):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert not fp[0].is_contiguous(), "the parameter's layout changed"


@pytest.mark.parametrize("name", list(NATIVE))
def test_amp_skip_and_unscale(name):
    """found_inf != 0: nothing changes (step counters included); grad_scale:
    the same step as unscaled gradients."""
    spec = NATIVE[name]
    init = _params(spec, torch.float32)
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]
    oa, ob = spec.cls(a, **spec.rich), spec.cls(b, **spec.rich)
    gen = torch.Generator().manual_seed(3)
    gs = [torch.randn(p.shape, generator=gen) for p in init]
    oa.step(gs)
    ob.step(gs)
    before = [p.clone() for p in a], {k: {n: v.clone() for n, v in e.items()} for k, e in oa.state_dict()["state"].items()}
    oa.step([g * 1024 for g in gs], grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(1.0))
    for p, q in zip(a, before[0]):
        assert torch.equal(p, q)
    for k, e in oa.state_dict()["state"].items():
        for n, v in e.items():
            assert torch.equal(v, before[1][k][n]), (k, n)
    oa.step([g * 1024 for g in gs], grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    ob.step(gs)
    for p, q in zip(a, b):
        assert torch.equal(p, q)  # g * 1024 / 1024 == g exactly


def _flat_state(opt, params):
    sd = opt.state_dict()["state"]
    return sd


def test_op_checks_before_it_changes_anything():
    p = torch.ones(8)
    v = torch.zeros(8)
    e = torch.empty(0)
    s = torch.zeros(())
    h = [0.01, 0.99, 1e-8, 0.0, 0.0, 0.0, 0.0]
    good = dict(params=[p, torch.ones(3)], grads=[torch.ones(8), torch.ones(3)],
                state=[s, s.clone(), v, torch.zeros(3), e, e, e, e])
    bad = [
        (dict(good, grads=[torch.ones(8)]), "2 params, 1 grads"),
        (dict(good, state=good["state"][:-1]), "expected 8"),
        (dict(good, grads=[torch.ones(8), torch.ones(6)[::2]]), "gradient 1"),
        (dict(good, grads=[torch.ones(8), torch.ones(3, dtype=torch.float64)]), "gradient 1"),
        (dict(good, state=[s, s, v, torch.zeros(4), e, e, e, e]), "state 1 of parameter 1"),
    ]
    for kw, msg in bad:
        before = [t.clone() for t in kw["params"] + kw["state"]]
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.funcopt.step_("rmsprop", kw["params"], kw["grads"], kw["state"], h)
        for t, b in zip(kw["params"] + kw["state"], before):
            assert torch.equal(t, b), msg
    with pytest.raises(RuntimeError, match="unknown rule 'nope'"):
        torch.ops.funcopt.step_("nope", [p], [p], [], [])
    with pytest.raises(RuntimeError, match="hyperparameters, expected 7"):
        torch.ops.funcopt.step_("rmsprop", good["params"], good["grads"], good["state"], h[:3])
    assert torch.equal(p, torch.ones(8))


def test_op_bumps_version_counters():
    """Autograd's check for tensors modified in place after being saved sees the step."""
    w = torch.ones(4, requires_grad=True)
    opt = funcopt.RMSprop([w], lr=0.1)
    assert opt.uses_native
    loss = (w * w).sum()  # saves w
    opt.step([torch.ones(4)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_impl_choices():
    w = torch.zeros(3)
    assert funcopt.RMSprop([w], impl="native").uses_native
    assert not funcopt.RMSprop([w], impl="foreach").uses_native
    assert not funcopt.RMSprop([w], foreach=True).uses_native
    with pytest.raises(ValueError, match="Adam has no native rule"):
        funcopt.Adam([w], impl="native")
    # dtypes and devices the rule does not take: the foreach formula, quietly
    assert not funcopt.RMSprop([torch.zeros(3, dtype=torch.bfloat16)]).uses_native


def test_every_rule_has_its_algorithm():
    rules = {spec.native_rule: name for name, spec in NATIVE.items()}
    assert set(rules) <= set(native.RULES)
    for rule in rules:
        assert (native.SOURCE_DIR / f"{rule}.cpp").exists(), rule
        py = native.SOURCE_DIR / f"{rule}.py"
        assert py.exists(), f"{rule}.cpp sits beside its formula {py.name}"


# ------------------------------------------------------------------ fallbacks
CHILD_FALLBACK = textwrap.dedent(
    """
    import warnings, torch
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as w:
        import funcopt
        from funcopt import native
        a = torch.ones(5, requires_grad=True)
        b = torch.ones(5, requires_grad=True)
        fo = funcopt.RMSprop([a], lr=0.1, momentum=0.9)
        fo2 = funcopt.Adadelta([torch.zeros(2)])
        to = torch.optim.RMSprop([b], lr=0.1, momentum=0.9, foreach=True)
        for i in range(3):
            g = torch.full((5,), 0.5 + i)
            fo.step([g]); b.grad = g.clone(); to.step()
    ours = [x for x in w if issubclass(x.category, native.NativeUnavailableWarning)]
    print("uses_native", fo.uses_native, fo2.uses_native)
    print("warnings", len(ours))
    for x in ours:
        print("text", str(x.message)[:200])
    print("equal", torch.equal(a, b))
    """
)


def _child(env_extra, tmp_path):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", CHILD_FALLBACK], env=env, capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)


def test_off_runs_foreach_quietly(tmp_path):
    r = _child({"FUNCOPT_NATIVE": "0"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "uses_native False False" in r.stdout
    assert "warnings 0" in r.stdout
    assert "equal True" in r.stdout


def test_no_compiler_falls_back_with_one_notice(tmp_path):
    """An empty cache and a compiler that fails: one NativeUnavailableWarning
    naming the cause, then torch's exact foreach numbers."""
    r = _child({"FUNCOPT_CACHE_DIR": str(tmp_path / "cache"), "CXX": "/bin/false"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "uses_native False False" in r.stdout, r.stdout
    assert "warnings 1" in r.stdout, r.stdout
    assert "native optimizer kernels unavailable" in r.stdout and "FUNCOPT_NATIVE=0" in r.stdout
    assert "equal True" in r.stdout


def test_required_but_unavailable_is_an_error(tmp_path):
    code = ("import funcopt, torch\n"
            "try:\n    funcopt.RMSprop([torch.zeros(2)])\nexcept RuntimeError as e:\n    print('error', e)\n")
    env = dict(os.environ, FUNCOPT_CACHE_DIR=str(tmp_path / "cache"), CXX="/bin/false", FUNCOPT_NATIVE="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "error funcopt: FUNCOPT_NATIVE=1 but the native kernels are unavailable" in r.stdout


# ------------------------------------------------------------------ embedding
class _Step(torch.nn.Module):
    def __init__(self, core, params):
        super().__init__()
        self.params = params
        self.opt = core

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        grads: list[torch.Tensor | None] = [g for _ in self.params]
        self.opt.step(grads, None, None)
        return self.params[0].sum()


CHILD_EMBED = textwrap.dedent(
    """
    import sys
    class _NoFuncopt:
        def find_spec(self, name, path=None, target=None):
            if name == "funcopt" or name.startswith("funcopt."):
                raise ImportError("funcopt must not be imported here")
    sys.meta_path.insert(0, _NoFuncopt())
    import torch
    lib = sys.argv[2] if len(sys.argv) > 2 else ""
    if lib:
        torch.ops.load_library(lib)  # the one line docs/index.md shows
    try:
        m = torch.jit.load(sys.argv[1])
    except RuntimeError as e:
        print("load error:", " ".join(str(e).split())[:400])
        raise SystemExit(0)
    for i in range(3):
        m(torch.ones(4))
    print("trained", m.params[0].tolist())
    """
)


def _embed(tmp_path, core_attr):
    w = torch.zeros(4)
    opt = funcopt.RMSprop([w], lr=0.1)
    assert opt.uses_native
    m = _Step(getattr(opt, core_attr), [w])
    path = str(tmp_path / f"{core_attr}.pt")
    with quiet_jit():
        torch.jit.save(torch.jit.script(m), path)
    ref = torch.zeros(4)
    ro = funcopt.RMSprop([ref], lr=0.1, impl="foreach")
    for i in range(3):
        ro.step([torch.ones(4)])
    return path, ref


def _run_child(args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", CHILD_EMBED, *args], env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_saved_core_calls_aten_only(tmp_path):
    """opt.core (what users embed) steps with the foreach formula: the saved
    module trains where funcopt and its library are absent, as torch does."""
    path, ref = _embed(tmp_path, "core")
    out = _run_child([path])
    assert out.startswith("trained"), out
    assert torch.equal(torch.tensor(eval(out.split("trained", 1)[1])), ref)


def test_saved_step_core_needs_the_library_and_says_so(tmp_path):
    path, ref = _embed(tmp_path, "step_core")
    out = _run_child([path])
    assert "load error:" in out and "funcopt::step_" in out, out
    out = _run_child([path, str(native.library_path())])
    assert out.startswith("trained"), out
    torch.testing.assert_close(torch.tensor(eval(out.split("trained", 1)[1])), ref, **TOL[torch.float32])


# ------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("name", list(NATIVE))
def test_compiled_step_is_one_op_and_equals_eager(name):
    """torch.compile(opt.step, fullgraph=True) traces the op through its fake
    implementation (no graph break) and gives the eager native numbers."""
    import torch._dynamo

    spec = NATIVE[name]
    init = _params(spec, torch.float32)
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]
    oa, ob = spec.cls(a, **spec.rich), spec.cls(b, **spec.rich)
    torch._dynamo.reset()
    step = torch.compile(oa.step, fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    for t in range(3):
        gs = [torch.randn(p.shape, generator=gen) for p in init]
        step(gs)
        ob.step(gs)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_native_bucket_agrees_with_native_dtypes():
    """The scripted core's ``native_bucket`` (TorchScript cannot read the Python tuple) takes
    exactly ``funcopt.native.NATIVE_DTYPES`` on the CPU."""
    from funcopt.optimizers._core import native_bucket

    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.int64):
        assert native_bucket(torch.empty(0, dtype=dt)) == (dt in native.NATIVE_DTYPES), dt


def _builder(cache: pathlib.Path, code: str) -> "subprocess.Popen[str]":
    env = dict(os.environ, FUNCOPT_CACHE_DIR=str(cache))
    env.pop("FUNCOPT_NATIVE", None)
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_killed_build_then_two_concurrent_builders(tmp_path):
    """A build SIGKILLed in the middle leaves no library in place (it compiles in a private
    directory, renamed into place only when done); two processes that then build into the
    same empty cache at once both load the same, complete library."""
    import time

    p = _builder(tmp_path, "from funcopt import native; native.build()")
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*/build-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(2.0)  # the compiler is running
    p.kill()
    p.wait(timeout=30)
    assert not list(tmp_path.glob("*/funcopt_native.so"))
    code = ("from funcopt import native; p = native.load(); assert p is not None, native.status(); "
            "import torch; assert torch.ops.funcopt.parallel_width(1) == 1; print(p)")
    procs = [_builder(tmp_path, code) for _ in range(2)]
    outs = [q.communicate(timeout=240)[0] for q in procs]
    assert [q.returncode for q in procs] == [0, 0], outs
    paths = {o.strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1 and pathlib.Path(paths.pop()).is_file(), outs

"""Shared test helpers: deterministic random parameters and gradients.

Grids: the registry-driven tests run every grid point of an algorithm where a
case is cheap and the pairwise cover ``spec.pairs()`` where it is expensive
(scripted, float64, for-loop parity); set ``FUNCOPT_FULL_GRID=1`` to run every
grid point everywhere (``funcopt/registry.py``, README "Run the tests").

The factories are session-scoped fixtures (plain functions), so hypothesis
tests may use them too.
"""
from typing import List, Optional, Sequence

import pytest
import torch

import _oracles  # noqa: E402  (tests/ is on sys.path: this conftest's directory)

_oracles.install()  # the oracles outside torch used as their docs say (tests/_oracles.py)

DEFAULT_SHAPES = ((3, 4), (5,), (), (2, 1, 3))



# the registry algorithm the running test is parametrized with ("name"), if
# any: make_params then shapes its tensors as that algorithm's torch class
# takes them (spec.param_shape: Muon matrices only, Adafactor no empty ones)
_CURRENT_SPEC: list = [None]


@pytest.fixture(autouse=True)
def _algorithm_under_test(request):
    from funcopt.registry import REGISTRY

    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("name") if callspec is not None else None
    _CURRENT_SPEC[0] = REGISTRY.get(name) if isinstance(name, str) else None
    yield
    _CURRENT_SPEC[0] = None


def _params(shapes: Sequence = DEFAULT_SHAPES, dtype: torch.dtype = torch.float32, seed: int = 0) -> List[torch.Tensor]:
    """Leaf tensors with ``requires_grad``; the same seed gives the same values."""
    gen = torch.Generator().manual_seed(seed)
    spec = _CURRENT_SPEC[0]
    if spec is not None:
        shapes = [spec.param_shape(tuple(s)) for s in shapes]
    return [torch.randn(tuple(s), generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _grads(params: Sequence[torch.Tensor], step: int, seed: int = 1) -> List[Optional[torch.Tensor]]:
    """One fresh gradient per parameter, a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def _clone(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


@pytest.fixture(scope="session")
def make_params():
    return _params


@pytest.fixture(scope="session")
def make_grads():
    return _grads


@pytest.fixture(scope="session")
def clone_params():
    return _clone


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """This process as a gloo world of one (``file://`` rendezvous, a 30 s bound on
    every collective), for construction-time and single-rank checks of the
    distributed layers without spawning; ``destroy_process_group`` in ``finally``."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def rpc_world_of_one(tmp_path):
    """This process as an RPC world of one (``worker0``, TensorPipe, ``file://``
    rendezvous, a 30 s bound on every RPC); ``rpc.shutdown`` in ``finally``."""
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{tmp_path / 'rpc-rendezvous'}", rpc_timeout=30)
    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        yield
    finally:
        rpc.shutdown()


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests: on a shared
    2-core machine, waking torch's thread pool for a 12-element fused kernel
    can cost milliseconds.  Results do not depend on it (elementwise ops)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    """One intra-op thread for the whole suite: the tests use tiny tensors, for
    which waking torch's thread pool costs more than the work (milliseconds per
    fused step on a busy 2-core machine).  Results do not depend on it."""
    torch.set_num_threads(1)
    config.addinivalue_line("markers", "rest: in the rest tier only (docs/testing.md); README's command skips it")


# ------------------------------------------------------------------ tiers
# README's test command runs the default tier: every behaviour, every algorithm
# and every distributed layer at least once, grids over their pairwise cover,
# world sizes 1, 2, 4.  The rest tier holds what the default tier leaves out:
# the items named in REST below and every grid point beyond the pairwise cover.
#
#   python -m pytest -q                          default tier
#   FUNCOPT_TIER=rest python -m pytest -q        the rest only (CI runs it after the default tier)
#   FUNCOPT_FULL_GRID=1 python -m pytest -q      both tiers, every grid point everywhere
#
# FUNCOPT_TIER=rest implies FUNCOPT_FULL_GRID=1 and deselects every test the
# default tier collects (asked of a default-tier collection in a subprocess),
# so the two runs together are exactly the full run.
import os as _os  # noqa: E402
import re as _re  # noqa: E402

TIER = _os.environ.get("FUNCOPT_TIER", "default")
if TIER not in ("default", "rest"):
    raise pytest.UsageError(f"FUNCOPT_TIER must be 'default' or 'rest', got {TIER!r}")
if TIER == "rest":
    _os.environ["FUNCOPT_FULL_GRID"] = "1"
FULL = _os.environ.get("FUNCOPT_FULL_GRID", "") not in ("", "0")

# (node id pattern, why it is in the rest tier); a pattern matches from the
# start of the node id.  The default tier keeps a cheaper test of the same
# behaviour beside each one (named in the reason).
REST = [
    (r"tests/test_wheel\.py::test_(version|demo_outside|bad_lr|bench_quick)",
     "a fresh venv with torch installed from the registry, then every subcommand (~5 min); "
     "the default tier builds the wheel and runs it on the installed torch (test_wheel_runs_in_place)"),
    (r"tests/test_cli_zero\.py::test_demo_zero_shards_state\[[23]\]",
     "the demo at ZeRO-2 and -3 (spawned processes); the default tier runs --zero 1, "
     "tests/distributed tests ZeRO-2/3 themselves"),
    (r"tests/test_compile\.py::test_every_algorithm_compiles_fullgraph\[(?!Adam\]|SGD\]|Muon\]|Adafactor\]|RMSprop\])",
     "torch.compile of each algorithm (seconds each); the default tier compiles Adam, SGD, RMSprop, Muon, Adafactor"),
    (r"tests/test_extending\.py::test_toy_algorithm_in_one_file_joins_every_layer",
     "a toy algorithm through every layer in spawned processes (~60 s); the default tier's registry contract, "
     "script, ZeRO, RPC and FSDP2 tests run every registered algorithm through the same layers"),
    (r"tests/distributed/test_zero3(_checkpoint)?\.py::\w+\[(.*-)?3\]",
     "ZeRO-3 at world size 3 (a third pool of ranks: its start-up and first-job warm-up cost ~15 s on 2 cores "
     "for one world size); the default tier's W=2 and W=4 shard unevenly too (70, 45 and 18 elements at W=4 "
     "are padded: test_zero3 test_chunks_are_one_over_world[4]) and W=2 loads W=4's checkpoint across unaligned "
     "chunk boundaries (test_zero3_checkpoint test_save_w4_load_and_continue[...-2])"),
    (r"tests/optimizers/test_native\.py::test_killed_build_then_two_concurrent_builders",
     "three builds of the native library in fresh processes (~60-90 s on 2 cores); the default tier builds "
     "it once and tests the fallback with a broken compiler (test_native)"),
    (r"tests/(test_\w+|optimizers/test_blocked)\.py::\w+\[(.*-)?(AdamWScheduleFree|SGDScheduleFree|Prodigy|ADOPT|AdEMAMix|SOAP)[-\]]",
     "the registry-driven contract, parity, state-dict, layout and property cases of the six rules beyond torch "
     "(issue 23); the default tier runs each one's own oracle tests (tests/optimizers/test_{schedulefree,prodigy,"
     "adopt,ademamix,soap}.py: parity eager/scripted/compiled, None gradients, layouts, state dicts both ways, "
     "refusals) and tests/distributed/test_group_rules.py"),
    (r"tests/distributed/test_overlap\.py::\w+\[.*-4\]",
     "the step inside backward (DDP hook, ZeRO overlap) at world size 4: every case again with four ranks "
     "on two cores (~25 s); the default tier runs every case at world sizes 1 and 2 (several buckets per "
     "iteration, shards on two ranks), and ZeRO, ZeRO-3 and the bucketer at 4"),
    (r"tests/distributed/test_group_rules\.py::\w+\[4[-\]]",
     "the per-group rules under ZeRO-1/2 at world size 4 (a second pool of ranks); the default tier runs every "
     "case at world size 2 (flat and greedy, ZeRO-1 and -2)"),
    (r"tests/distributed/test_rpc\.py::(test_matches_local_torch_optim\[parity:(AdamWScheduleFree|SGDScheduleFree|"
     r"Prodigy|ADOPT|AdEMAMix|SOAP):(first:torch|last:funcopt)\]|test_three_trainers_in_turn_match_local_torch_optim"
     r"\[(AdamWScheduleFree|SGDScheduleFree|ADOPT|AdEMAMix|SOAP)\])",
     "the six rules beyond torch through the RPC optimizer beyond one parity run each (the oracle-class trainer, "
     "the last combination, three trainers in turn); the default tier runs each one's first combination with "
     "funcopt's class and Prodigy's three trainers (its two-round step under contention)"),
    (r"tests/distributed/test_zero3\.py::test_training_matches_torch\[stack-(AdamWScheduleFree|SGDScheduleFree|"
     r"Prodigy|ADOPT|AdEMAMix|SOAP)-(eager-[14]|scripted-[12])\]",
     "ZeRO-3 of the rules beyond torch at the other world sizes and modes; the default tier runs each one eager "
     "at world size 2 and scripted at 4"),
    (r"tests/test_layouts\.py::test_every_layout_1m_elements\[\w+-(auto-scripted|foreach-eager)\]",
     "the 1M-element layouts of each algorithm in two of its four impl x mode combinations; the default tier "
     "runs auto eager and foreach scripted (every impl and mode once), and every combination on small layouts"),
    (r"tests/test_contracts\.py::test_parity_with_torch_for_loop_float64\[\w+-\w+-scripted\]",
     "the scripted optimizers against torch's for-loop path in float64; the default tier runs the eager ones "
     "(every grid point for foreach) and test_script compares every scripted algorithm with its eager twin"),
    (r"tests/embed/",
     "compiles a libtorch C++ program (~20 s); the default tier loads saved train steps in a Python process "
     "that never imports funcopt (test_script, test_native)"),
]
_REST_RE = [(_re.compile(p), why) for p, why in REST]


def in_rest(nodeid: str) -> bool:
    return any(r.match(nodeid) for r, _ in _REST_RE)


def _default_tier_ids(config) -> set:
    import subprocess
    import sys

    env = {k: v for k, v in _os.environ.items() if k not in ("FUNCOPT_TIER", "FUNCOPT_FULL_GRID")}
    args = [str(a) for a in config.args]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=str(config.invocation_params.dir), env=env, capture_output=True, text=True,
                       timeout=900)
    if r.returncode not in (0, 5):
        raise pytest.UsageError("FUNCOPT_TIER=rest: collecting the default tier failed:\n" + r.stdout[-3000:]
                                + r.stderr[-3000:])
    return {line.strip() for line in r.stdout.splitlines() if "::" in line}


def pytest_collection_modifyitems(config, items):
    if FULL and TIER != "rest":
        return  # FUNCOPT_FULL_GRID=1: both tiers
    if TIER == "rest":
        default = _default_tier_ids(config)
        drop = [it for it in items if it.nodeid in default]
    else:
        drop = [it for it in items if in_rest(it.nodeid) or it.get_closest_marker("rest") is not None]
    if drop:
        dropped = {id(it) for it in drop}
        keep = [it for it in items if id(it) not in dropped]
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# FUNCOPT_EXTRA_ALGORITHMS: paths of algorithm files (a formula file that ends
# with its one ``registry.register(...)`` call) to load before collection, so
# the registry-driven tests run over them too (tests/test_extending.py).
def _load_extra_algorithms() -> None:
    import importlib.util
    import os

    for path in filter(None, os.environ.get("FUNCOPT_EXTRA_ALGORITHMS", "").split(os.pathsep)):
        name = "funcopt_extra_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        import sys

        sys.modules[name] = module  # TorchScript finds the kernel's source through its module
        spec.loader.exec_module(module)


_load_extra_algorithms()

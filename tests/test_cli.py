"""The command line: ``python -m funcopt demo`` and a silent ``import funcopt``."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    # run against this checkout even when funcopt is not pip-installed
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args, timeout):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _run_many(argvs, timeout):
    """``_run`` of each argument list, two fresh interpreters at a time (the
    2-core machine: each start-up is an ``import torch`` on one core); results
    in order.  The same commands, each in its own interpreter, as ``_run``."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as ex:
        return list(ex.map(lambda a: _run(a, timeout), argvs))


_DEMOS = {"losses": ["-m", "funcopt", "demo", "--steps", "20", "--no-progress"],
          "progress": ["-m", "funcopt", "demo", "--steps", "3"]}
_QUICK = {"import": ["-W", "error", "-c", "import funcopt"],
          "import-cli": ["-W", "error", "-c", "import funcopt.cli"],
          "version": ["-m", "funcopt", "--version"],
          "usage": ["-m", "funcopt"]}


@pytest.fixture(scope="module")
def demos():
    """Both demo runs, side by side (each its own interpreter)."""
    return dict(zip(_DEMOS, _run_many(list(_DEMOS.values()), timeout=240)))


@pytest.fixture(scope="module")
def quick():
    """The four quick commands, two at a time (each its own interpreter)."""
    return dict(zip(_QUICK, _run_many(list(_QUICK.values()), timeout=120)))


def test_demo_losses_equal(demos):
    r = demos["losses"]
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^(torch\.optim\.Adam\(fused=True\)|funcopt\.script\(funcopt\.Adam\))\s+(\S+)\s+(\S+)$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert set(rows) == {"torch.optim.Adam(fused=True)", "funcopt.script(funcopt.Adam)"}, r.stdout
    loss_t, loss_f = rows["torch.optim.Adam(fused=True)"][0], rows["funcopt.script(funcopt.Adam)"][0]
    assert loss_t == loss_f
    assert loss_t == loss_t and loss_t < 1.0  # finite, and it trained
    assert "final losses bitwise equal: yes" in r.stdout
    assert "parameters bitwise equal: yes" in r.stdout
    assert "step time ratio torch/funcopt:" in r.stdout


def test_demo_progress_bar_on_stderr(demos):
    r = demos["progress"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3/3" in r.stderr  # tqdm
    assert "final losses bitwise equal: yes" in r.stdout


def test_import_is_silent(quick):
    r = quick["import"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


def test_import_cli_is_silent(quick):
    r = quick["import-cli"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


def test_version(quick):
    r = quick["version"]
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"funcopt \S+ \(torch \S+, Python \S+\)\n", r.stdout), r.stdout
    assert r.stderr == ""


def test_usage_errors(quick):
    r = quick["usage"]
    assert r.returncode == 2 and "COMMAND" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# (arguments, what the one line must name): each refused before anything is spawned.
BAD = [
    (["demo", "--steps", "0"], "--steps must be at least 1"),
    (["demo", "--steps", "x"], "--steps: invalid int value"),
    (["demo", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["demo", "--threads", "-2"], "--threads must be at least 1"),
    (["demo", "--zero", "1", "--world-size", "0"], "--world-size must be at least 1"),
    (["demo", "--zero", "2", "--world-size", "-3"], "--world-size must be at least 1"),
    (["demo", "--zero", "4"], "--zero: invalid choice"),
    (["demo", "--zero", "1", "--steps", "0"], "--steps must be at least 1"),
    (["demo", "--rpc", "--trainers", "0"], "--trainers must be at least 1"),
    (["demo", "--rpc", "--steps", "0"], "--steps must be at least 1"),
    (["demo", "--rpc", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["demo", "--rpc", "--zero", "1"], "separate demos"),
    (["demo", "--world-size", "2"], "--world-size needs --zero"),
    (["demo", "--trainers", "2"], "--trainers is for --rpc"),
    (["demo", "--zero", "1", "--world-size", "2", "--batch-size", "5"], "not divisible"),
    (["bench", "--only", "gpu"], "--only"),
    (["bench", "step", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "step", "--algos", "Shampoo"], "unknown algorithm"),
    (["bench", "step", "--sizes", "huge"], "--sizes"),
    (["demo", "--overlap"], "--overlap is for --zero 1"),
    (["demo", "--zero", "2", "--overlap"], "--overlap is for --zero 1"),
    (["demo", "--fsdp2", "--zero", "1"], "--fsdp2 is its own demo"),
    (["demo", "--fsdp2", "--rpc"], "--fsdp2 is its own demo"),
    (["demo", "--checkpoint-dir", "d"], "--checkpoint-dir is for --zero 1|2|3 and --fsdp2"),
    (["demo", "--optimizer", "adafactor"], "--optimizer is for --zero 1|2|3 and --fsdp2"),
    (["demo", "--zero", "3", "--optimizer", "adafactor"], "needs each parameter whole"),
    (["demo", "--zero", "1", "--optimizer", "sgd"], "--optimizer: invalid choice"),
    (["demo", "--zero", "1", "--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["demo", "--zero", "1", "--checkpoint-dir", "d", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["demo", "--zero", "1", "--checkpoint-dir", "d", "--checkpoint-keep", "-1"], "--checkpoint-keep must be at least 1"),
    (["demo", "--zero", "1", "--overlap", "--checkpoint-dir", "d"], "do not go together"),
    (["demo", "--fsdp2", "--world-size", "2", "--batch-size", "5"], "not divisible"),
    (["bench", "zero", "--world-size", "0"], "--world-size must be at least 1"),
    (["bench", "zero", "--iters", "0"], "--iters must be at least 1"),
    (["bench", "zero", "--lr", "-1"], "--lr"),
    (["bench", "rpc", "--trainers", "0"], "trainer count"),
    (["bench", "rpc", "--reps", "0"], "--reps must be at least 1"),
]


@pytest.mark.parametrize("argv,says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_one_line_exit_2(argv, says, capsys, monkeypatch):
    """In-process (one torch import for all cases); the subprocess tests above and
    below check the same path end to end."""
    from funcopt.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    try:
        code = main([*argv, "--no-progress"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out + err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], (argv, err)
    assert "Traceback" not in err and out == "", (argv, out)


def test_bad_lr_is_refused_before_anything_runs():
    """Every demo trains with Adam: an lr torch.optim.Adam refuses is one line and
    exit code 2, checked before any process is spawned (it used to hang with --rpc)."""
    cases = ((["--rpc"], "-1"), (["--zero", "1"], "nan"), ([], "-0.5"), (["--zero", "2"], "-1"))
    runs = _run_many([["-m", "funcopt", "demo", *extra, "--lr", lr, "--steps", "3", "--no-progress"]
                      for extra, lr in cases], timeout=120)
    for (extra, lr), r in zip(cases, runs):
        assert r.returncode == 2, (extra, lr, r.stdout + r.stderr)
        assert r.stderr.strip().splitlines() == [
            f"funcopt demo: --lr {float(lr):g}: Invalid learning rate: {float(lr)}"], (extra, lr, r.stderr)
        assert r.stdout == "", (extra, lr, r.stdout)


@pytest.mark.parametrize("lr", [-1.0, float("nan"), -0.5, 0.0, 1e-3, float("inf")])
def test_lr_check_says_what_torch_says(lr):
    import torch

    from funcopt.demos._common import lr_problem

    try:
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=lr)
        expected = None
    except ValueError as e:
        expected = str(e)
    assert lr_problem(lr) == expected


def test_package_never_runs_examples_or_benchmarks():
    """Everything the command line runs ships in the package: no module of
    funcopt/ imports, opens or runs a file from examples/ or benchmarks/.

    Flagged: ``runpy``, changes to ``sys.path``, and any string without
    whitespace (a path, a module name, not prose) naming those directories."""
    import ast

    offenders = []
    for path in sorted((ROOT / "funcopt").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            what = None
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("runpy", "examples", "benchmarks") for n in names):
                    what = "imports " + ", ".join(n for n in names if n)
            elif isinstance(node, ast.Attribute) and node.attr in ("run_path", "run_module"):
                what = node.attr
            elif (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                  and node.value.id == "sys"):
                what = "sys.path"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.search(r"\s", node.value):
                if re.search(r"(^|[/\\.])(examples|benchmarks)($|[/\\.])", node.value):
                    what = repr(node.value)
            if what:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")
    assert not offenders, "\n".join(offenders)


def test_bench_help():
    layers = ("step", "zero", "rpc")
    r, *per_layer = _run_many([["-m", "funcopt", "bench", "--help"]]
                              + [["-m", "funcopt", "bench", layer, "--help"] for layer in layers], timeout=120)
    assert r.returncode == 0 and "funcopt bench" in r.stdout and "--quick" in r.stdout, r.stdout + r.stderr
    for layer, r in zip(layers, per_layer):
        assert r.returncode == 0 and f"funcopt bench {layer}" in r.stdout, r.stdout + r.stderr

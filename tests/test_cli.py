"""The command line: ``python -m funcopt demo`` and a silent ``import funcopt``."""
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_demo_losses_equal():
    r = _run(["-m", "funcopt", "demo", "--steps", "20", "--no-progress"], timeout=240)
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


def test_demo_progress_bar_on_stderr():
    r = _run(["-m", "funcopt", "demo", "--steps", "3"], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3/3" in r.stderr  # tqdm
    assert "final losses bitwise equal: yes" in r.stdout


def test_import_is_silent():
    r = _run(["-W", "error", "-c", "import funcopt"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


def test_import_cli_is_silent():
    r = _run(["-W", "error", "-c", "import funcopt.cli"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


def test_usage_errors():
    r = _run(["-m", "funcopt"], timeout=120)
    assert r.returncode == 2 and "COMMAND" in r.stderr
    r = _run(["-m", "funcopt", "demo", "--steps", "0"], timeout=120)
    assert r.returncode == 2 and "--steps" in r.stderr


def test_bad_lr_is_refused_before_anything_runs():
    """Every demo trains with Adam: an lr torch.optim.Adam refuses is one line and
    exit code 2, checked before any process is spawned (it used to hang with --rpc)."""
    for extra, lr in ((["--rpc"], "-1"), (["--zero", "1"], "nan"), ([], "-0.5")):
        r = _run(["-m", "funcopt", "demo", *extra, "--lr", lr, "--steps", "3", "--no-progress"], timeout=120)
        assert r.returncode == 2, (extra, lr, r.stdout + r.stderr)
        assert r.stderr.strip().splitlines() == [
            f"funcopt demo: --lr {float(lr):g}: Invalid learning rate: {float(lr)}"], (extra, lr, r.stderr)
        assert r.stdout == "", (extra, lr, r.stdout)


def test_bench_passes_arguments_through():
    r = _run(["-m", "funcopt", "bench", "--help"], timeout=120)
    assert r.returncode == 0 and "funcopt bench" in r.stdout
    r = _run(["-m", "funcopt", "bench", "--", "--help"], timeout=240)
    if (ROOT / "benchmarks" / "step.py").is_file():
        assert r.returncode == 0, r.stdout + r.stderr
        assert "step.py" in r.stdout  # the benchmark's own usage line
    else:
        assert r.returncode == 2 and "benchmarks/step.py not found" in r.stderr

"""A saved TorchScript train step holding a funcopt optimizer keeps training
in a C++ program linked against libtorch only (``examples/cpp/train_step.cpp``):
no Python, no funcopt, no funcopt native library.  Its parameters after the
C++ steps equal the same steps run eagerly in Python, bitwise, for an
algorithm with a native rule (RMSprop: ``opt.core`` steps with the foreach
formula, ATen ops only), one with an ATen fused kernel (Adam), and three of the
rules beyond torch (Prodigy, AdamWScheduleFree, SOAP).

The program is built with the compiler funcopt's native kernels use; where
none works the test is skipped, naming it.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

import funcopt
from funcopt.script import quiet_jit

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "examples" / "cpp" / "train_step.cpp"
STEPS = 7


def _example():
    spec = importlib.util.spec_from_file_location("train_step_script", ROOT / "examples" / "train_step_script.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Data(torch.nn.Module):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("x", x)
        self.register_buffer("y", y)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build examples/cpp/train_step.cpp")
    torch_dir = pathlib.Path(torch.__file__).parent
    out = tmp_path_factory.mktemp("cpp") / "train_step"
    cmd = [cxx, "-std=c++17", "-O1", str(SRC), f"-I{torch_dir / 'include'}",
           f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-L{torch_dir / 'lib'}",
           "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(out)]
    if not torch._C._GLIBCXX_USE_CXX11_ABI:
        cmd.insert(1, "-D_GLIBCXX_USE_CXX11_ABI=0")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


# + rules beyond torch (issue 23): per-group values and a two-phase step (Prodigy),
# the train-mode interpolation (Schedule-Free), a whole-parameter eigenbasis (SOAP)
@pytest.mark.parametrize("algo", ["RMSprop", "Adam", "Prodigy", "AdamWScheduleFree", "SOAP"])
def test_cpp_program_trains_the_saved_step(program, algo, tmp_path):
    ex = _example()
    cls = getattr(funcopt, algo)
    torch.manual_seed(0)
    m = ex.TrainStep(lambda ps: cls(ps, lr=0.01))
    torch.manual_seed(0)
    ref = ex.TrainStep(lambda ps: cls(ps, lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    with quiet_jit():
        torch.jit.save(torch.jit.script(m), str(tmp_path / "step.pt"))
        torch.jit.save(torch.jit.script(Data(x, y)), str(tmp_path / "data.pt"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    r = subprocess.run([str(program), str(tmp_path / "step.pt"), str(tmp_path / "data.pt"), str(STEPS),
                        str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"trained {STEPS} steps" in r.stdout
    got = torch.load(tmp_path / "out.pt", weights_only=False)  # written by the program above (a c10::List)
    # the reference: the same module, eager, same optimizer through opt.core's formula
    for _ in range(STEPS):
        ref.train_step(x, y)
    want = [p.detach() for p in ref.net.parameters()]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    before = [p.detach() for p in m.net.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(got, before)), "the C++ steps changed nothing"

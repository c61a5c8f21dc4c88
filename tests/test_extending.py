"""One formula file + one registry entry is all a new algorithm takes.

The test writes a toy algorithm (``Toy``: momentum scaled by ``1/sqrt(t)``,
with its own per-tensor reference optimizer as the oracle) into a temporary
module that ends with its single ``registry.register(...)`` call -- nothing
else anywhere -- and then runs the project's own registry-driven test
suites over it in a fresh interpreter (``FUNCOPT_EXTRA_ALGORITHMS``, read by
tests/conftest.py): parity (eager, scripted, float32/float64, every grid
point), state dicts both ways, contracts, layouts, AMP inputs, the optimizer
surface, torch.compile, the docs page, ZeRO and the RPC optimizer.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TOY = textwrap.dedent('''
    r"""Toy: momentum scaled by the inverse square root of the step count.

    Update rule (``g`` negated when ``maximize``)::

        m_t = beta * m_{t-1} + g
        p  -= lr * m_t / sqrt(t)
    """
    from typing import Any, Dict, List, Optional

    import torch
    from torch import Tensor

    from funcopt.base import Optimizer
    from funcopt.optimizers._common import scalars, step_tensor, step_values, zeros_like
    from funcopt.registry import AlgorithmSpec, register


    def toy(params: List[Tensor], grads: List[Tensor], bufs: List[Tensor], steps: List[Tensor],
            lr: float, beta: float, maximize: bool) -> None:
        if maximize:
            grads = torch._foreach_neg(grads)
        torch._foreach_mul_(bufs, beta)
        torch._foreach_add_(bufs, grads)
        if torch.compiler.is_compiling():
            scale = torch._foreach_rsqrt(steps)
            torch._foreach_mul_(scale, -lr)
            torch._foreach_addcmul_(params, bufs, scale)
            return
        torch._foreach_add_(params, torch._foreach_mul(bufs, scalars([-lr / s ** 0.5 for s in step_values(steps)])))


    class ToyKernel:
        def __init__(self) -> None:
            self.name = "Toy"

        def init(self, p: Tensor, fused: bool, h: Dict[str, float]) -> List[Tensor]:
            return [step_tensor(p, fused), zeros_like(p)]

        def check(self, params: List[Tensor], idx: List[int], grads: List[Tensor], h: Dict[str, float],
                  odd: bool) -> None:
            pass

        def dense(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                  h: Dict[str, float], fused: bool, first: bool, grad_scale: Optional[Tensor],
                  found_inf: Optional[Tensor]) -> None:
            toy(params, grads, state[1], state[0], h["lr"], h["beta"], h["maximize"] != 0.0)

        def single(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                   h: Dict[str, float], first: bool) -> List[List[Tensor]]:
            for j in range(len(params)):
                g = grads[j] if h["maximize"] == 0.0 else -grads[j]
                buf = state[1][j]
                buf.mul_(h["beta"]).add_(g)
                params[j].add_(buf * (-h["lr"] / state[0][j] ** 0.5))
            return state


    class ToyReference(torch.optim.Optimizer):
        """The oracle: the same rule, one tensor at a time."""

        def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9, foreach: Optional[bool] = None,
                     maximize: bool = False, differentiable: bool = False) -> None:
            if lr < 0:
                raise ValueError(f"Invalid learning rate: {lr}")
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta value: {beta}")
            super().__init__(params, dict(lr=lr, beta=beta, foreach=foreach, maximize=maximize,
                                          differentiable=differentiable))

        def __setstate__(self, state: Any) -> None:  # older checkpoints: defaults for newer switches
            super().__setstate__(state)
            for group in self.param_groups:
                for k in ("foreach", "maximize", "differentiable"):
                    group.setdefault(k, None if k == "foreach" else False)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["step"] = torch.tensor(0.0)
                        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["step"] += 1
                    g = p.grad if not group["maximize"] else -p.grad
                    st["momentum_buffer"].mul_(group["beta"]).add_(g)
                    p.add_(st["momentum_buffer"] * (-group["lr"] / st["step"].item() ** 0.5))
            return loss


    class Toy(Optimizer):
        """Toy momentum (see the module docstring)."""

        torch_class = ToyReference
        kernel_class = ToyKernel
        slots = (("step", None), ("momentum_buffer", None))
        sparse_msg = "Toy does not support sparse gradients"

        def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9, foreach: Optional[bool] = None,
                     maximize: bool = False, differentiable: bool = False, impl: str = "auto") -> None:
            super().__init__(params, dict(lr=lr, beta=beta, foreach=foreach, maximize=maximize,
                                          differentiable=differentiable), impl)


    register(AlgorithmSpec("Toy", Toy, base=dict(lr=0.05), grid=dict(beta=[0.0, 0.9], maximize=[False, True]),
                           rich=dict(lr=0.05, beta=0.5)))
''')

# the registry-driven suites, and the parts of them that run over every algorithm
SUITES = [
    "tests/test_parity.py", "tests/test_state_dict.py", "tests/test_contracts.py", "tests/test_layouts.py",
    "tests/test_amp_inputs.py", "tests/test_optimizer_surface.py", "tests/test_messages.py",
    "tests/test_script.py", "tests/test_compile.py::test_every_algorithm_compiles_fullgraph",
    "tests/test_registry.py",
]


@pytest.mark.timeout(900)
def test_toy_algorithm_in_one_file_joins_every_layer(tmp_path):
    path = tmp_path / "toy_algorithm.py"
    path.write_text(TOY)
    env = dict(os.environ, FUNCOPT_EXTRA_ALGORITHMS=str(path), PYTHONPATH=str(ROOT))
    env.pop("FUNCOPT_TIER", None)  # this test runs in the rest tier; the inner run is the default tier's suites
    # 1. the registry-driven suites, over the toy only
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "Toy", "-W",
         "ignore::pytest.PytestUnknownMarkWarning", *SUITES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=850,
    )
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    summary = [ln for ln in out.stdout.splitlines() if " passed" in ln]
    assert summary and int(summary[-1].split(" passed")[0].split()[-1]) >= 40, tail
    # 2. the layers outside the test suites: top-level export, docs, ZeRO (W=1) and RPC (W=1)
    script = textwrap.dedent(f'''
        import importlib.util, os, sys, tempfile
        spec = importlib.util.spec_from_file_location("toy_algorithm", {str(path)!r})
        mod = importlib.util.module_from_spec(spec); sys.modules["toy_algorithm"] = mod; spec.loader.exec_module(mod)
        import torch, torch.distributed as dist, funcopt
        from funcopt import registry
        assert funcopt.Toy is mod.Toy and "## Toy" in registry.markdown()

        def run(opt_step, params, n=4):
            g = torch.Generator().manual_seed(1)
            for _ in range(n):
                opt_step([torch.randn(p.shape, generator=g) for p in params])

        base = [torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.randn(5)]
        ref = [p.clone().requires_grad_() for p in base]
        run(funcopt.Toy(ref, lr=0.05).step, ref)

        from funcopt.distributed.zero import ZeroRedundancyOptimizer
        store = tempfile.mktemp()
        dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
        try:
            ps = [p.clone().requires_grad_() for p in base]
            zero = ZeroRedundancyOptimizer(ps, optimizer_class=mod.ToyReference, lr=0.05)
            assert zero.algorithm() == "Toy", zero.algorithm()
            def zstep(grads):
                for p, g in zip(ps, grads):
                    p.grad = g
                zero.step()
            run(zstep, ps)
            assert all(torch.equal(a, b) for a, b in zip(ps, ref))
        finally:
            dist.destroy_process_group()

        import torch.distributed.rpc as rpc, torch.distributed.autograd as dist_autograd
        from funcopt.distributed.rpc import DistributedOptimizer
        rpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="file://" + tempfile.mktemp(), rpc_timeout=60))
        try:
            ps = [p.clone().requires_grad_() for p in base]
            opt = DistributedOptimizer("Toy", [rpc.RRef(p) for p in ps], lr=0.05)
            g = torch.Generator().manual_seed(1)
            for _ in range(4):
                grads = [torch.randn(p.shape, generator=g) for p in ps]
                with dist_autograd.context() as ctx:
                    loss = sum((p * gr).sum() for p, gr in zip(ps, grads))
                    dist_autograd.backward(ctx, [loss])
                    opt.step(ctx)
            assert all(torch.equal(a, b) for a, b in zip(ps, ref))
        finally:
            rpc.shutdown()
        print("LAYERS OK")
    ''')
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "LAYERS OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]

"""A whole training step -- forward, loss, gradients, optimizer step -- in one
TorchScript module, saved to a file that runs without Python source.

The optimizer is the *core* of a funcopt optimizer (``opt.core``): a
TorchScript-compatible object that holds the parameter list and the state
tensors.  The module keeps it as an attribute; ``torch.jit.script`` compiles
the core's ``step`` together with ``train_step``.  The saved file carries the
optimizer state and code, so ``torch.jit.load`` (in C++ or in a Python process
that never imports funcopt) can keep training.

Run::

    python examples/train_step_script.py --steps 50 --out train_step.pt
"""
from __future__ import annotations

import argparse
from typing import List

import torch
from torch import Tensor, nn

import funcopt
from funcopt.script import quiet_jit


class TrainStep(nn.Module):
    """A small MLP regressor that trains itself: ``train_step(x, y) -> loss``.

    ``make_opt`` builds a funcopt optimizer over the module's parameters, e.g.
    ``lambda ps: funcopt.Adam(ps, lr=1e-2)``; only its core is kept.
    """

    def __init__(self, make_opt, n_in: int = 8, hidden: int = 32, n_out: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))
        params = list(self.net.parameters())
        # A plain List[Tensor] attribute: the *same* tensor objects as the
        # registered parameters (TorchScript keeps the aliasing), so
        # autograd.grad differentiates w.r.t. them and the optimizer updates
        # them in place.
        self.params: List[Tensor] = params
        self.opt = make_opt(params).core

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    @torch.jit.export
    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        loss = torch.nn.functional.mse_loss(self.forward(x), y)
        # In TorchScript autograd.grad returns List[Optional[Tensor]], which is
        # exactly what the optimizer step takes (None = no gradient, skipped).
        grads = torch.autograd.grad([loss], self.params)
        self.opt.step(grads, None, None)
        return loss.detach()


def make_data(n: int = 256, n_in: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    w = torch.randn(n_in, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default="train_step.pt", help="where to torch.jit.save the trained module")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = TrainStep(lambda ps: funcopt.Adam(ps, lr=args.lr))
    with quiet_jit():
        scripted = torch.jit.script(model)
    x, y = make_data()
    for step in range(args.steps):
        loss = scripted.train_step(x, y)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    with quiet_jit():
        torch.jit.save(scripted, args.out)
    print(f"saved {args.out}")

    # The saved module keeps training where it stopped, optimizer state included.
    with quiet_jit():
        loaded = torch.jit.load(args.out)
    print(f"reloaded: one more step, loss {loaded.train_step(x, y).item():.5f}")


if __name__ == "__main__":
    main()

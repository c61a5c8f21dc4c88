"""accelerate with a funcopt optimizer: ``prepare``, ``backward``, ``clip_grad_norm_``,
``accumulate`` and ``save_state`` / ``load_state``, unchanged from a torch.optim loop.

    pip install "funcopt[integrations]"
    python examples/accelerate_loop.py
"""
import tempfile

import torch
from accelerate import Accelerator

import funcopt

if __name__ == "__main__":
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = funcopt.script(funcopt.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    with tempfile.TemporaryDirectory() as ckpt:
        for i in range(16):
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4])
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if i == 7:
                acc.save_state(ckpt)  # model, funcopt optimizer state, scheduler, RNG
        acc.load_state(ckpt)          # back to the state after 8 micro-batches
    print(f"loss {loss.item():.4f}")

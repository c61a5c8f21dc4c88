"""Mixed precision on the CPU: ``torch.autocast`` (bfloat16) and ``torch.amp.GradScaler``
with a funcopt optimizer; a step whose gradients overflow is skipped, as with torch.optim.

    python examples/amp_grad_scaler.py
"""
import torch

import funcopt

if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = funcopt.script(funcopt.Adam(model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    for i in range(8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[8 * i:8 * i + 8])
        loss = torch.nn.functional.mse_loss(out.float(), y[8 * i:8 * i + 8])
        scaler.scale(loss).backward()
        if i == 3:
            model[0].weight.grad[0, 0] = float("inf")  # an overflow: this step is skipped
        scaler.step(opt)
        scaler.update()
        print(f"step {i}: loss {loss.item():.4f}, scale {scaler.get_scale():.0f}")

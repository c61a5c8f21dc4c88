"""``funcopt demo``: torch.optim.Adam(fused=True) against scripted funcopt.Adam, bitwise.

Trains one small MLP twice from identical weights on identical batches: once
with ``torch.optim.Adam(fused=True)`` and once with
``funcopt.script(funcopt.Adam(...))``.  funcopt's default CPU path calls the
same fused ATen kernel, so both runs must end bitwise equal; the demo returns
1 when they do not.  Only ``optimizer.step`` is timed, interleaved.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import List

from ._common import H1, H2, IN, make_data, make_model, table


def run(args: argparse.Namespace) -> int:
    """The demo; its exit code (0: bitwise equal)."""
    import torch
    from tqdm import tqdm

    import funcopt

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps, batch = args.steps, args.batch_size
    xs, ys = make_data(args.seed, steps, batch)
    model_t = make_model(args.seed)
    model_f = copy.deepcopy(model_t)
    params_t = list(model_t.parameters())
    params_f = list(model_f.parameters())
    n_params = sum(p.numel() for p in params_t)

    opt_t = torch.optim.Adam(params_t, lr=args.lr, fused=True)
    t0 = time.perf_counter()
    opt_f = funcopt.script(funcopt.Adam(params_f, lr=args.lr))
    script_s = time.perf_counter() - t0

    loss_fn = torch.nn.functional.mse_loss
    times_t: List[float] = []
    times_f: List[float] = []
    loss_t = loss_f = float("nan")
    warmup = min(10, steps // 5)
    print(f"funcopt demo: MLP {IN}-{H1}-{H2}-1 ({n_params:,} parameters), {steps} steps, batch {batch}, "
          f"Adam lr={args.lr:g}, seed {args.seed}, {torch.get_num_threads()} threads", flush=True)
    bar = tqdm(range(steps), desc="training", unit="step", disable=args.no_progress, file=sys.stderr)
    for k in bar:
        x, y = xs[k], ys[k]
        # torch.optim: gradients through p.grad, as usual.
        opt_t.zero_grad(set_to_none=True)
        lt = loss_fn(model_t(x), y)
        lt.backward()
        # funcopt: the functional step, gradients passed explicitly.
        lf = loss_fn(model_f(x), y)
        grads = list(torch.autograd.grad(lf, params_f))
        # Time only the optimizer steps; alternate which goes first.  The first
        # steps allocate state and let TorchScript's profiling executor
        # specialise the scripted step: not timed.
        for which in ((0, 1) if k % 2 == 0 else (1, 0)):
            s = time.perf_counter()
            if which == 0:
                opt_t.step()
            else:
                opt_f.step(grads)
            if k >= warmup:
                (times_t if which == 0 else times_f).append(time.perf_counter() - s)
        loss_t, loss_f = lt.item(), lf.item()
        if not args.no_progress and (k % 10 == 0 or k == steps - 1):
            bar.set_postfix(loss=f"{loss_f:.4g}")
    bar.close()

    with torch.no_grad():  # loss of the trained models on the last batch
        final_t = loss_fn(model_t(xs[-1]), ys[-1]).item()
        final_f = loss_fn(model_f(xs[-1]), ys[-1]).item()
    params_equal = all(torch.equal(a, b) for a, b in zip(params_t, params_f))
    losses_equal = final_t == final_f and loss_t == loss_f
    med_t = statistics.median(times_t) * 1e6 if times_t else float("nan")
    med_f = statistics.median(times_f) * 1e6 if times_f else float("nan")
    print()
    for line in table(("optimizer", "final loss", "median step (us)"),
                      (("torch.optim.Adam(fused=True)", repr(final_t), f"{med_t:.1f}"),
                       ("funcopt.script(funcopt.Adam)", repr(final_f), f"{med_f:.1f}"))):
        print(line)
    print()
    print(f"step time ratio torch/funcopt: {med_t / med_f:.2f}x (>1: funcopt is faster; median over "
          f"{len(times_f)} steps after {warmup} warm-up steps; scripting took {script_s:.2f} s once)")
    print(f"final losses bitwise equal: {'yes' if losses_equal else 'NO'}")
    print(f"parameters bitwise equal: {'yes' if params_equal else 'NO'}")
    if not (losses_equal and params_equal):
        print("funcopt demo: FAILED: funcopt and torch.optim diverged", file=sys.stderr)
        return 1
    return 0

"""The demo model and data, shared by every demo; plain tables."""
from __future__ import annotations

import os
from typing import Any, Iterable, List, Optional, Sequence

# Sizes of the demo MLP: 64 -> 256 -> 128 -> 1, 49,665 parameters.
IN, H1, H2 = 64, 256, 128


def make_model(seed: int) -> Any:
    """The demo MLP, initialised from ``seed``."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, H1), torch.nn.ReLU(), torch.nn.Linear(H1, H2),
                               torch.nn.ReLU(), torch.nn.Linear(H2, 1))


def make_data(seed: int, steps: int, batch: int) -> Any:
    """``steps`` batches of a synthetic regression (a fixed random teacher plus noise): (xs, ys)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    teacher_w = torch.randn(IN, 1, generator=gen) / IN**0.5
    xs = torch.randn(steps, batch, IN, generator=gen)
    ys = torch.tanh(xs @ teacher_w) + 0.1 * xs[..., :1] ** 2 + 0.01 * torch.randn(steps, batch, 1, generator=gen)
    return xs, ys


def tensor_bytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def lr_problem(lr: float) -> Optional[str]:
    """torch.optim.Adam's complaint about ``lr`` (every demo trains with Adam), or None.

    The same test and words as torch's (``not 0.0 <= lr``: negative or NaN),
    without importing torch, so that a bad argument is refused at once;
    tests/test_cli.py checks the words against torch.optim.Adam itself."""
    if not 0.0 <= lr:
        return f"Invalid learning rate: {lr}"
    return None


def rank_threads(threads: Optional[int], local_world: int) -> int:
    """Intra-op threads per rank: ``threads``, else this machine's cores shared by its ranks."""
    if threads is not None:
        return threads
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    """A plain right-aligned text table (first column left-aligned)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]

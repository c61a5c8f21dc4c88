"""``strategy="ddp"`` on 2 CPU processes for ``test_lightning.py``: every registry
algorithm, torch.optim and funcopt eager, one after another in the same
launch; rank 0 saves ``{(name, flavour): final params}`` to ``sys.argv[1]``.

Lightning's DDP launcher re-runs this script for rank 1 (it cannot run inside pytest)."""
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
import _lightning_common as L  # noqa: E402

import _oracles  # noqa: E402
from _common import snapshot  # noqa: E402
from funcopt.registry import REGISTRY  # noqa: E402

_oracles.install()  # Schedule-Free's oracles built in train mode, as under pytest (tests/_oracles.py)


def main(out: str) -> None:
    results = {}
    rank = 0
    for name in REGISTRY:
        for flavour in ("torch", "eager"):  # scripted: the single-process tests
            module = L.Module(name, flavour)
            if flavour == "torch":
                results[(name, "init")] = snapshot(module.parameters())
            # one optimizer step per epoch (2 batches per rank, accumulated); SOAP's first step
            # only sets its preconditioner up (as pytorch_optimizer's): a second epoch moves it
            epochs = 2 if name == "SOAP" else 1
            L.fit(module, Path(out).parent / f"ddp-{name}-{flavour}", max_epochs=epochs, strategy="ddp", devices=2,
                  accumulate_grad_batches=2, gradient_clip_val=0.5)
            results[(name, flavour)] = snapshot(module.parameters())
            rank = module.global_rank
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])

"""The LightningModule and Trainer set-up shared by ``test_lightning.py`` and its DDP
script (``_lightning_ddp.py``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from _common import make_optimizer, tiny_data, tiny_model


class Module(pl.LightningModule):
    """The tiny regression model; ``configure_optimizers`` returns the optimizer and a
    StepLR in an LR-scheduler dict stepped every optimizer step."""

    def __init__(self, name: str, flavour: str, manual: bool = False) -> None:
        super().__init__()
        self.net = tiny_model()
        self.name, self.flavour = name, flavour
        self.automatic_optimization = not manual
        self.lrs: List[float] = []

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.lr_schedulers().step()
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_optimizers(self) -> Any:
        opt = make_optimizer(self.name, self.flavour, self.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


def fit(module: Module, root: Path, max_epochs: int, checkpoint: bool = False, ckpt_path: Any = None,
        **trainer: Any) -> List[Path]:
    """Fit on 32 samples in batches of 8 (no shuffling); returns the checkpoints written."""
    root = Path(root)
    callbacks = []
    if checkpoint:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, every_n_epochs=1))
    t = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=trainer.pop("devices", 1), logger=False,
                   enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=root, callbacks=callbacks, **trainer)
    t.fit(module, DataLoader(tiny_data(), batch_size=8), ckpt_path=ckpt_path)
    return sorted((root / "ckpt").glob("*.ckpt")) if checkpoint else []

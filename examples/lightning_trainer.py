"""PyTorch Lightning with a funcopt optimizer: ``configure_optimizers`` returns it (scripted,
with an LR-scheduler dict) exactly as it would return a torch.optim optimizer.

    pip install "funcopt[integrations]"
    python examples/lightning_trainer.py
"""
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import funcopt


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = funcopt.script(funcopt.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, accumulate_grad_batches=2,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), data)
    print(f"final loss {trainer.callback_metrics.get('train_loss', float('nan'))}; steps {trainer.global_step}")

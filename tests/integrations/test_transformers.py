"""transformers ``Trainer`` with ``optimizers=(optimizer, scheduler)``: funcopt gives
torch.optim's numbers, and ``resume_from_checkpoint`` continues exactly.

A one-layer GPT-2 built from a config (no download), gradient accumulation 2,
``max_grad_norm``, a linear-warmup scheduler; for every registry algorithm, funcopt
eager and scripted against the torch.optim class of the same name (float32 rtol 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from _common import (algorithm_cases, assert_close, assert_equal, assert_trained, finite, make_optimizer, need,
                     snapshot)

need("transformers", "accelerate")

import transformers  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
CASES = algorithm_cases()
MAX_STEPS, SAVE_AT = 4, 2
_ORACLE: dict = {}


class Tokens(torch.utils.data.Dataset):
    """16 random sequences of 8 tokens; the labels are the inputs (language modelling)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 32, (16, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def train(name: str, flavour: str, out: str, resume: str = None, config: str = "rich") -> list:
    model = tiny_gpt2()
    opt = make_optimizer(name, flavour, model.parameters(), config=config)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=MAX_STEPS)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
        max_steps=MAX_STEPS, save_strategy="steps", save_steps=SAVE_AT, logging_strategy="no", report_to=[],
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    return snapshot(model.parameters())


@pytest.mark.parametrize("name,flavour", CASES)
def test_trainer_matches_torch_optim_and_resumes_exactly(name, flavour, tmp_path):
    if name not in _ORACLE:
        # the registry's rich configuration, or its base one where torch.optim itself ends in
        # NaN with rich on this model (Adafactor with eps1=1e-30)
        config = "rich"
        want = train(name, "torch", str(tmp_path / "torch"))
        if not finite(want):
            config = "base"
            want = train(name, "torch", str(tmp_path / "torch-base"), config=config)
        _ORACLE[name] = config, want
    config, want = _ORACLE[name]
    assert finite(want), f"{name}: torch.optim diverges with the rich and the base configuration"
    assert_trained(snapshot(tiny_gpt2().parameters()), want, f"{name} torch.optim")
    got = train(name, flavour, str(tmp_path / "straight"), config=config)
    assert_close(got, want, f"{name} {flavour} ({config}) vs torch.optim", algo=name)
    checkpoint = str(tmp_path / "straight" / f"checkpoint-{SAVE_AT}")
    resumed = train(name, flavour, str(tmp_path / "resumed"), resume=checkpoint, config=config)
    assert_equal(resumed, got, f"{name} {flavour}: resumed from checkpoint-{SAVE_AT} vs uninterrupted")

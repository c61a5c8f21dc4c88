"""transformers' ``Trainer`` with ``optimizers=(funcopt optimizer, scheduler)`` on a tiny
GPT-2 built from a config (nothing is downloaded); checkpoints and
``resume_from_checkpoint`` save and restore the funcopt state like torch.optim's.

    pip install "funcopt[integrations]"
    python examples/transformers_trainer.py
"""
import tempfile

import torch
import transformers

import funcopt


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    opt = funcopt.script(funcopt.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=8)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4,
                                              gradient_accumulation_steps=2, max_grad_norm=1.0, max_steps=8,
                                              save_steps=4, report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched))
        print(trainer.train())

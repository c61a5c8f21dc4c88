"""FSDP2 (``fully_shard``) with a funcopt optimizer on 2 CPU processes (gloo), checkpointed
with torch.distributed.checkpoint.  funcopt steps each rank's local shards through its
fused/scripted kernels (no DTensor dispatch); ``opt.state`` holds DTensors like torch.optim's,
so ``get_state_dict`` / ``dcp.save`` / ``dcp.load`` / ``set_state_dict`` work unchanged.

    python examples/fsdp2_dcp.py
"""
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import funcopt


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, funcopt.script(funcopt.AdamW(model.parameters(), lr=1e-2))


def main(rank: int, world: int, ckpt: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{ckpt}/rendezvous", rank=rank, world_size=world)
    try:
        model, opt = build()
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{ckpt}/step3")

        model2, opt2 = build()  # resume elsewhere: a fresh model and optimizer
        msd2, osd2 = get_state_dict(model2, opt2)
        sd = {"model": msd2, "optim": osd2}
        dcp.load(sd, checkpoint_id=f"{ckpt}/step3")
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        same = all(torch.equal(a.full_tensor(), b.full_tensor())
                   for a, b in zip(model.parameters(), model2.parameters()))
        if rank == 0:
            with open(f"{ckpt}/result.txt", "w") as f:
                f.write(f"restored parameters equal: {same}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        torch.multiprocessing.spawn(main, args=(2, d), nprocs=2)
        with open(f"{d}/result.txt") as f:
            print(f.read())

"""FSDP2 in the style of the PyTorch example: fully_shard per block, then the root."""
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.GELU()) for _ in range(3)])


def main():
    dist.init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    model = build()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7 + rank)
    for _ in range(4):
        inputs = torch.randn(8, 24, generator=generator)
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    checksum = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    if rank == 0:
        print(f"fsdp loss {loss.item()!r} checksum {checksum!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

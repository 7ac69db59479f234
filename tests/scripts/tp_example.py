"""Tensor parallelism in the style of the PyTorch TP example: a device mesh and parallelize_module."""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = torch.nn.Linear(16, 32)
        self.relu = torch.nn.ReLU()
        self.out_proj = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = parallelize_module(ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    for step in range(5):
        torch.manual_seed(100 + step)  # the same input on every rank, as the example does
        inputs = torch.rand(4, 16)
        loss = model(inputs).pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    checksum = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    if dist.get_rank() == 0:
        print(f"tp loss {loss.item()!r} checksum {checksum!r}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
    dist.destroy_process_group()

"""A DDP trainer in the style of the PyTorch tutorial: argparse, a Trainer class, torchrun's environment."""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, data, optimizer, local_rank):
        self.local_rank = local_rank
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.data = data
        self.optimizer = optimizer

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def train(self, epochs):
        for epoch in range(epochs):
            for source, targets in self.data:
                loss = self._run_batch(source, targets)
        return loss


def main(epochs, batch_size):
    ddp_setup()
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    generator = torch.Generator().manual_seed(1 + local_rank)
    data = [(torch.randn(batch_size, 20, generator=generator), torch.randn(batch_size, 1, generator=generator))
            for _ in range(8)]
    trainer = Trainer(model, data, torch.optim.SGD(model.parameters(), lr=0.05), local_rank)
    loss = trainer.train(epochs)
    checksum = sum(float(p.detach().double().sum()) for p in trainer.model.parameters())
    if trainer.global_rank == 0:
        print(f"world {world_size} loss {loss!r} checksum {checksum!r}")
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    main(args.epochs, args.batch_size)
    sys.exit(0)

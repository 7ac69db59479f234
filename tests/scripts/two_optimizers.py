"""A GAN-style loop: two DDP models, two optimizers, so two optimizer steps per training step.

It marks its steps with ``labkit.step()`` and logs its losses with ``labkit.log``; both do nothing under
plain torchrun, where it runs as well.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit


def main():
    dist.init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    generator_net = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    critic = DDP(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    g_optimizer = torch.optim.Adam(generator_net.parameters(), lr=1e-3)
    c_optimizer = torch.optim.Adam(critic.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(3 + rank)
    for _ in range(6):
        with labkit.step():
            real = torch.randn(12, 4, generator=data)
            noise = torch.randn(12, 8, generator=data)
            fake = generator_net(noise)
            c_loss = F.softplus(-critic(real)).mean() + F.softplus(critic(fake.detach())).mean()
            c_optimizer.zero_grad()
            c_loss.backward()
            c_optimizer.step()
            g_loss = F.softplus(-critic(fake)).mean()
            g_optimizer.zero_grad()
            g_loss.backward()
            g_optimizer.step()
            labkit.log(loss=c_loss, generator_loss=g_loss)
    checksum = sum(float(p.detach().double().sum()) for p in generator_net.parameters())
    if rank == 0:
        print(f"gan loss {g_loss.item()!r} checksum {checksum!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

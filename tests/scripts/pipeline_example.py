"""Pipeline parallelism in the style of the pipelining tutorial: one stage per rank, GPipe."""
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

LAYERS = 4


def main():
    dist.init_process_group("gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(LAYERS)]
    per_stage = LAYERS // world_size
    stage_module = torch.nn.Sequential(*layers[rank * per_stage:(rank + 1) * per_stage])
    stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: (out - target).pow(2).mean())
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        inputs, targets = torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)
        losses = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == world_size - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    checksum = torch.tensor([sum(float(p.detach().double().sum()) for p in stage_module.parameters())],
                            dtype=torch.float64)
    dist.all_reduce(checksum)
    if rank == world_size - 1:
        print(f"pipeline loss {float(torch.stack(losses).mean())!r} checksum {float(checksum)!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

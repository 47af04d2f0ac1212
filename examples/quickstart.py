# torchrun --nproc-per-node 2 examples/quickstart.py
import torch
import torch.distributed as dist
from torch import nn
import pipecore as pc

class Block(nn.Module):                                # a residual MLP block, as in a transformer
    def __init__(self, d=64):
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x):
        return x + self.mlp(x)

dist.init_process_group("gloo")                        # one process per rank ("nccl" on GPUs)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                                   # every rank builds the same model and data
model, teacher = nn.Sequential(*[Block() for _ in range(8)]), nn.Linear(64, 64).requires_grad_(False)
sched = pc.build_schedule("zbv", world, num_microbatches=8)  # zero-bubble V: 2 stages per rank
parts = pc.partition(model, sched.num_stages)          # the 8 blocks split evenly over the stages
stages = [pc.PipelineStage(parts[s], s, sched.num_stages) for s in sched.rank_stages(rank)]
pipe = pc.Pipeline(stages, sched, 8, loss_fn=nn.functional.mse_loss)
opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)    # each parameter once
for step in range(100):
    x, losses = torch.randn(32, 64), []                # the batch: 8 microbatches of 4 rows
    pipe.step(*((x,) if pipe.has_first else ()), target=teacher(x) if pipe.has_last else None, losses=losses)
    opt.step()
    opt.zero_grad()
    if pipe.has_last and step % 20 == 19:              # the last stage's rank has the losses
        print(f"step {step + 1}: loss {torch.stack(losses).mean():.4f}")
dist.destroy_process_group()

"""The roadmap's stage-1 code made complete: a bare torchrun DDP loop, nothing of distlab.

Started by ddp_vs_bare.py under torchrun on loopback only (distlab.launchers.torchrun's
torchrun_script_command): bare_ddp.py --model DIR --data DIR --micro-batch 4 --steps 30 --out out.json.
Times each optimizer step exactly like distlab's loop (perf_counter around the step, max
over ranks), so the two can be compared side by side.
"""
import json
import statistics
import time

import datasets
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DistributedSampler
from transformers import AutoModelForCausalLM

from bench_common import loop_parser


def main():
    a = loop_parser(__doc__).parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = DDP(AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    blocks = datasets.load_from_disk(a.data)["train"].with_format("torch", columns=["input_ids"])[:]["input_ids"]
    sampler = DistributedSampler(range(len(blocks)), num_replicas=world, rank=rank, shuffle=True, seed=1234,
                                 drop_last=True)
    batches = iter(BatchSampler(sampler, a.micro_batch, drop_last=True))
    times, losses = [], []
    for _ in range(a.steps):
        start = time.perf_counter()
        x = blocks[next(batches)]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    all_times = [None] * world
    dist.all_gather_object(all_times, times)
    if rank == 0:
        step = [max(t[i] for t in all_times) for i in range(a.steps)]
        med = statistics.median(step[a.warmup:])
        tokens = a.micro_batch * world * blocks.shape[1]
        json.dump({"median_step_s": med, "tokens_per_s": tokens / med, "losses": losses}, open(a.out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The same work as a distlab DDP run, under transformers.Trainer (the tool users would pick).

Started by trainer_parity.py under torchrun on loopback only (distlab.launchers.torchrun's
torchrun_script_command): trainer_run.py --model DIR --data DIR --micro-batch B --steps S --out out.json.
Same model (fp32), token blocks, batch order (distlab's DistributedSampler stream per rank,
handed to Trainer as an ordered dataset it reads sequentially; Accelerate gives rank r every
N-th batch), threads, AdamW (lr 3e-4, no weight decay, constant schedule, no clipping).
Each optimizer step is timed from Trainer's on_step_begin to on_step_end (forward, backward,
all-reduce, optimizer step, zero_grad), max over ranks, like distlab's loop; the losses are
Trainer's own logged ones.
"""
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator

from bench_common import loop_parser
from distlab.data_prep.data import load_blocks
from distlab.rank.loop import IndexStream
from distlab.records.spec import Spec


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.losses, self._start = [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


class InOrder(Trainer):
    """Reads the dataset in the order given (distlab's sampler order, built below)."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


def ordered_samples(blocks, world: int, micro_batch: int, steps: int, seed: int) -> list[dict]:
    """Micro-batch k of rank r at position (k * world + r): Accelerate hands rank r every world-th batch."""
    spec = Spec({"sampler": "distributed", "seed": seed, "micro_batch": micro_batch})
    streams = [IndexStream(len(blocks), spec, rank, world) for rank in range(world)]
    order = [i for _ in range(steps) for stream in streams for i in stream.next()]
    return [{"input_ids": blocks[i], "labels": blocks[i]} for i in order]


def main():
    p = loop_parser(__doc__)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    blocks = load_blocks(a.data, "train")
    import os

    world = int(os.environ.get("WORLD_SIZE", 1))
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, use_cpu=True, per_device_train_batch_size=a.micro_batch,
                                 max_steps=a.steps, learning_rate=3e-4, weight_decay=0.0, lr_scheduler_type="constant",
                                 warmup_steps=0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                                 report_to="none", seed=a.seed, dataloader_drop_last=True, ddp_backend="gloo",
                                 remove_unused_columns=False, optim="adamw_torch", disable_tqdm=True)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        trainer = InOrder(model=model, args=args, data_collator=default_data_collator, callbacks=[timer],
                          train_dataset=ordered_samples(blocks, world, a.micro_batch, a.steps, a.seed))
        trainer.train()
    times = [timer.times]
    if dist.is_initialized():
        times = [None] * dist.get_world_size()
        dist.all_gather_object(times, timer.times)
    if not dist.is_initialized() or dist.get_rank() == 0:
        step = [max(t[i] for t in times) for i in range(len(times[0]))]
        median = statistics.median(step[a.warmup:])
        tokens = a.micro_batch * world * blocks.shape[1]
        with open(a.out, "w") as fh:
            json.dump({"median_step_s": median, "tokens_per_s": tokens / median, "losses": timer.losses,
                       "step_times": step}, fh)


if __name__ == "__main__":
    main()

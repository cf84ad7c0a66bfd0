"""PyTorch DistributedDataParallel: every rank holds the whole model; gradients are
averaged with all-reduce in buckets while backward is still running."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distlab.strategies.base import Strategy


class CommTimer:
    """State of `timed_allreduce_hook`: seconds of all-reduce in flight, bucket count."""

    def __init__(self):
        self.seconds = 0.0
        self.buckets = 0


def timed_allreduce_hook(timer: CommTimer, bucket):
    """DDP communication hook = the default `allreduce_hook`, plus the time each bucket's
    all-reduce spends in flight (launch to completion). Buckets overlap backward compute,
    so this is time *in flight*, not time added to the step."""
    group = dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    start = time.perf_counter()
    future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def done(fut):
        timer.seconds += time.perf_counter() - start
        timer.buckets += 1
        return fut.value()[0]

    return future.then(done)


class DDPStrategy(Strategy):
    name = "ddp"
    expected_wrappers = ("DistributedDataParallel",)

    def wrap(self, model) -> None:
        model.to(self.ctx.device)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        self.hook = CommTimer()
        self.model.register_comm_hook(state=self.hook, hook=timed_allreduce_hook)
        self.optimizer = self.build_optimizer(self.trainable(self.model))

    def sync_context(self, is_last_micro: bool):
        # Gradient accumulation: all-reduce only on the last micro-batch of a step.
        return self.model.no_sync() if not is_last_micro else contextlib.nullcontext()

    def take_comm_seconds(self) -> float:
        value, self.hook.seconds = self.hook.seconds, 0.0
        return value

    def unwrapped(self):
        return self.model.module

    def save_checkpoint(self, path: str) -> None:
        from distlab.checkpoint import save_plain

        save_plain(self, path)

    def load_checkpoint(self, path: str) -> None:
        from distlab.checkpoint import load_plain

        load_plain(self, path)

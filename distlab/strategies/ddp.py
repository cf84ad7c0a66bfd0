"""PyTorch DistributedDataParallel: every rank holds the whole model; gradients are
averaged with all-reduce in buckets while backward is still running."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distlab.strategies.base import Strategy
from distlab.runtime.unequal import rank_batches


class CommTimer:
    """State of `timed_allreduce_hook`: each bucket's all-reduce as a (start, end) span, and
    the bucket count. `seconds` is the union of the spans (buckets queue one after another
    on the communication stream, so a plain sum would count the queueing twice).

    CPU (gloo): host clock marks. CUDA (NCCL): the host returns from all_reduce long before
    the GPU has done it, so host time is only the enqueue time; the marks are CUDA events
    instead: the start on the compute stream at launch (the NCCL stream waits for that point
    before the all-reduce starts), the end recorded in the future's callback, which runs on a
    stream synchronised with the NCCL kernels, so it completes when the all-reduce has.
    Read `seconds` after a device synchronize (the training loop does, at each step's end).
    """

    HOW = {"cpu": "host clock (time.perf_counter) at launch and in the all-reduce future's callback",
           "cuda": ("CUDA events: at launch on the compute stream, and in the future's callback on a stream "
                    "synchronised with the NCCL kernels; elapsed_time between them")}

    def __init__(self):
        self.buckets = 0
        self.device_type = None
        self._spans: list[tuple] = []

    def mark(self, device):
        self.device_type = device.type
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start, end) -> None:
        self._spans.append((start, end))
        self.buckets += 1

    @property
    def seconds(self) -> float:
        if not self._spans:
            return 0.0
        if self.device_type == "cuda":
            origin = self._spans[0][0]
            spans = [(origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3) for a, b in self._spans]
        else:
            spans = list(self._spans)
        return union_length(spans)

    @seconds.setter
    def seconds(self, value: float) -> None:
        if value:
            raise ValueError("CommTimer.seconds can only be reset to 0")
        self._spans.clear()


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, reach = 0.0, None
    for a, b in sorted(spans):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def timed_allreduce_hook(timer: CommTimer, bucket):
    """DDP communication hook = the default `allreduce_hook`, plus the time each bucket's
    all-reduce spends in flight (launch to completion; CommTimer says how on each device).
    Buckets overlap backward compute, so this is time *in flight*, not time added to the step."""
    group = dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    start = timer.mark(tensor.device)
    future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def done(fut):
        timer.add(start, timer.mark(tensor.device))
        return fut.value()[0]

    return future.then(done)


class DDPStrategy(Strategy):
    name = "ddp"
    expected_wrappers = ("DistributedDataParallel",)

    def wrap(self, model) -> None:
        model.to(self.ctx.device)
        # Unequal devices: each rank's micro-batch (given, or sized by probing: distlab.runtime.unequal).
        self.rank_batches, self.sizing = rank_batches(model, self.spec, self.ctx.device)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        self.hook = CommTimer()
        self.model.register_comm_hook(state=self.hook, hook=timed_allreduce_hook)
        self.optimizer = self.build_optimizer(self.trainable(self.model))

    def describe(self) -> dict:
        described = super().describe()
        if self.sizing:
            described["rank_micro_batch"] = self.sizing
        return described

    def sync_context(self, is_last_micro: bool):
        # Gradient accumulation: all-reduce only on the last micro-batch of a step.
        return self.model.no_sync() if not is_last_micro else contextlib.nullcontext()

    def take_comm_seconds(self) -> float:
        value, self.hook.seconds = self.hook.seconds, 0.0
        return value

    def facts_after_training(self) -> dict:
        return {"comm_timing": CommTimer.HOW[self.ctx.device.type]}

    def unwrapped(self):
        return self.model.module

    def save_checkpoint(self, path: str) -> None:
        from distlab.checkpoint_formats.plain import save_plain

        save_plain(self, path)

    def load_checkpoint(self, path: str) -> None:
        from distlab.checkpoint_formats.plain import load_plain

        load_plain(self, path)


# The class distlab.strategies finds for the strategy name "ddp" (its module name).
STRATEGY = DDPStrategy

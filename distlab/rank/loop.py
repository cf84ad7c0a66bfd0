"""The one training loop every strategy runs under (torchrun, accelerate launch or Ray).

It knows the Strategy interface and nothing about strategy names: data order, gradient
accumulation, timing and the per-step record are the same for all of them.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from distlab.records.spec import Spec
from distlab.runtime.accumulation import step_items, step_loss
from distlab.runtime.noise import NoiseProbe
from distlab.strategies.base import RunContext, Strategy


class IndexStream:
    """Endless micro-batches of sample indices for this data-parallel rank, epoch after epoch.

    sampler=distributed: DistributedSampler, disjoint shards of one seeded permutation.
    sampler=none: every rank walks the same permutation (the duplication demo).
    rank_batches (unequal devices, distlab.runtime.unequal): one permutation (a 1-replica
    DistributedSampler, what a 1-rank run reads) cut into global batches of sum(rank_batches);
    this rank takes its slice of each.
    """

    def __init__(self, n_samples: int, spec: Spec, dp_rank: int, dp_size: int, rank_batches: list[int] | None = None):
        self.spec = spec
        self.batch_size, self.slice = spec.micro_batch, None
        if rank_batches:
            self.batch_size = sum(rank_batches)
            start = sum(rank_batches[:dp_rank])
            self.slice = slice(start, start + rank_batches[dp_rank])
            dp_rank, dp_size = 0, 1
        if spec.sampler == "distributed":
            self.sampler = DistributedSampler(range(n_samples), num_replicas=dp_size, rank=dp_rank,
                                              shuffle=True, seed=spec.seed, drop_last=True)
        else:
            generator = torch.Generator().manual_seed(spec.seed)
            self.sampler = RandomSampler(range(n_samples), generator=generator)
        self.epoch = 0
        self.position = 0  # micro-batches drawn in the current epoch
        self._batches = self._epoch_batches()

    def state(self) -> dict:
        """Where this rank is in the data: saved in checkpoints so a resume reads on, not over."""
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict) -> "IndexStream":
        """Continue exactly where `state` was taken (same seed, sampler and world size)."""
        if not isinstance(self.sampler, DistributedSampler):
            # RandomSampler draws each epoch's permutation from one generator: replay the
            # finished epochs so the generator stands where it stood.
            self.sampler.generator.manual_seed(self.spec.seed)
            for _ in range(state["epoch"]):
                for _ in self.sampler:
                    pass
        self.epoch = state["epoch"]
        self._batches = self._epoch_batches()
        self.position = 0
        for _ in range(state["position"]):
            self.next()
        return self

    def epoch_plan(self) -> list[int]:
        """Every index this rank is due to read in epoch 0 (for the coverage proof)."""
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(0)
            plan = list(self.sampler)
            self.sampler.set_epoch(self.epoch)
            if self.slice is not None:  # this rank's slice of every whole global batch
                whole = len(plan) // self.batch_size * self.batch_size
                plan = [i for b in range(0, whole, self.batch_size) for i in plan[b:b + self.batch_size][self.slice]]
            return plan
        return list(range(len(self.sampler)))  # every rank plans the whole data set

    def _epoch_batches(self):
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
        return iter(BatchSampler(self.sampler, self.batch_size, drop_last=True))

    def next(self) -> list[int]:
        try:
            batch = next(self._batches)
        except StopIteration:
            self.epoch += 1
            self.position = 0
            self._batches = self._epoch_batches()
            batch = next(self._batches)
        self.position += 1
        return batch if self.slice is None else batch[self.slice]


def train(ctx: RunContext, strategy: Strategy, train_data, start_step: int = 0,
          stream: IndexStream | None = None, on_step_end=None, records: list | None = None,
          micro_context=None, profiler=None) -> dict:
    """Run optimizer steps start_step..steps-1; returns the per-step record of this rank.

    train_data: the task's samples (distlab.tasks.base.TrainData): the loop draws indices,
    the task turns them into the batch its loss takes.
    on_step_end(step) runs after each step (progress, trackers, eval points, periodic
    checkpoints: distlab.rank.monitor, distlab.rank.training_checkpoints); it is outside the timer.
    micro_context(step, micro): a context around one micro-batch's forward and backward (None:
    none), e.g. the activation-memory probe of an untimed step (distlab.runtime.activations).
    records: the records of steps before start_step when resuming; new ones are appended to it.
    profiler: a distlab.runtime.profiling.StepProfiler (None: none); it starts before the timer
    and stops after it, and a profiled step's record says so (its time includes the profiler's).
    Every step records its loss (the mean over the step's label tokens on every data-parallel
    rank: distlab.runtime.accumulation), the learning rate it used and the pre-clip global gradient norm; the
    strategy clips (max_grad_norm) and the LR schedule is stepped once per optimizer step.
    """
    spec = ctx.spec
    n_micro = spec.grad_accum
    if stream is None:
        stream = IndexStream(len(train_data), spec, strategy.data_parallel_rank, strategy.data_parallel_size,
                             getattr(strategy, "rank_batches", None))
    cuda = ctx.device.type == "cuda"
    records = [] if records is None else records
    state_bytes = None
    train_mode = strategy.train_mode()  # dropout on: from_pretrained hands over eval mode
    strategy.take_comm_seconds()
    noise = NoiseProbe()  # what else the machine did while the timed steps ran (distlab.runtime.noise)
    for step in range(start_step, spec.steps):
        if cuda:
            torch.cuda.synchronize(ctx.device)
        if step == max(start_step, ctx.untimed_steps):
            noise.start()
        if profiler is not None:
            profiler.before_step(step)
        start = time.perf_counter()
        lr = strategy.learning_rate()  # the rate this step's update uses
        shares, consumed, batches = [], [], []
        for _ in range(n_micro):  # the whole step's batches first: its item count comes before any forward
            indices = stream.next()
            consumed.extend(indices)
            batches.append(train_data.batch(indices, ctx.device, step))
        num_items = step_items(strategy, batches, ctx.device)  # over micro-batches and data-parallel ranks
        for micro, batch in enumerate(batches):
            with micro_context(step, micro) if micro_context else contextlib.nullcontext():
                share = strategy.forward_backward(batch, micro, n_micro, num_items)
            if share is not None:  # pipeline stages without the loss return None
                shares.append(share)
        del batches
        if step == spec.steps - 1:
            # Counted while gradients and optimizer state both exist: the peak model state.
            state_bytes = strategy.state_bytes()
        grad_norm = strategy.optimizer_step()  # clips to max_grad_norm; the norm is pre-clip
        strategy.step_scheduler()
        if cuda:
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - start
        profiled = profiler is not None and profiler.after_step(step)
        # After the timer: the loss's all-reduce and sync must not be billed to the step.
        records.append({"step": step, "loss": step_loss(shares, strategy), "step_time_s": elapsed,
                        "comm_inflight_s": strategy.take_comm_seconds(), "samples": consumed, "lr": lr,
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        **({"profiled": True} if profiled else {})})
        if on_step_end is not None:
            on_step_end(step)
    return {"records": records, "stream": stream, "state_bytes": state_bytes, "train_mode": train_mode,
            "noise": noise.stop()}


def gather(obj) -> list:
    """all_gather_object to every rank (small Python objects only: per-step records)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

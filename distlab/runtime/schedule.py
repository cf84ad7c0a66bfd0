"""The learning-rate schedule of a run: transformers.get_scheduler over the strategy's
optimizer, stepped once per optimizer step (distlab.rank.loop; DeepSpeed's engine steps the same
object itself), its state saved with each checkpoint's trainer state (distlab.checkpoints.trainer_state)."""
from __future__ import annotations

from distlab.records.spec import Spec


def scheduler_name(spec: Spec) -> str:
    """transformers' name for the spec's schedule: a warmed-up constant is constant_with_warmup."""
    if spec.lr_schedule == "constant":
        return "constant_with_warmup" if spec.lr_warmup_steps else "constant"
    return spec.lr_schedule


def lr_scheduler(spec: Spec, optimizer):
    """LambdaLR from transformers.get_scheduler: warm-up from 0 over lr_warmup_steps, then
    constant, linear or cosine decay to 0 at step `steps`."""
    from transformers import get_scheduler

    return get_scheduler(scheduler_name(spec), optimizer, num_warmup_steps=spec.lr_warmup_steps,
                         num_training_steps=spec.steps)


def expected_rates(spec: Spec) -> list[float]:
    """The learning rate of every step as transformers computes it on a fresh optimizer (for
    checks: what the loop recorded must be this)."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=spec.lr)
    scheduler = lr_scheduler(spec, optimizer)
    rates = []
    for _ in range(spec.steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates

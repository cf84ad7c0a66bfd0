"""One loss rule for every strategy: a step optimises the mean over the step's label tokens.

A step's global batch is cut into micro-batches (grad_accum), data-parallel ranks and, under
pipeline parallel, pipeline pieces. With masked labels (chat/instruction data: -100 on the
prompt) each part holds a different number of label tokens, so a mean of per-part means would
weight a token by how the batch was cut. As transformers' Trainer (`num_items_in_batch`, since
4.46) and torchtitan (`global_valid_tokens`) do, the step's items are counted from the batches
before the first forward (Task.loss_items: label tokens after the causal shift; images for
text-to-image), the count is all-reduced over the data-parallel ranks, and each part
back-propagates its *summed* loss divided by that count (Task.loss with num_items). The sum of
every part's gradient is then the gradient of the step's token mean, however it was cut.

Wrappers that reduce gradients by averaging undo part of that sum: DDP and FSDP divide by the
data-parallel size, DeepSpeed's engine.backward and Accelerate's accelerator.backward also by
their gradient_accumulation_steps. Each strategy names that divisor (Strategy.gradient_divisor)
and the loss is multiplied by it before backward. The step's reported loss is the same
quantity: the parts' detached shares summed over micro-batches and data-parallel ranks.
Unequal micro-batches per rank (distlab.runtime.unequal) need nothing more: the count is global.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def step_items(strategy, batches: list[dict], device) -> torch.Tensor:
    """The number of items (label tokens, images) the step's loss is a mean over: this rank's
    micro-batches counted, then summed over the data-parallel ranks (one all-reduce of an int)."""
    local = sum(int(strategy.task.loss_items(batch)) for batch in batches)
    count = torch.tensor(local, dtype=torch.int64, device=device)
    if strategy.data_parallel_size > 1:
        dist.all_reduce(count, group=strategy.data_parallel_group())
    if int(count) == 0:
        raise ValueError("this step's batches hold no label token on any rank (every label is -100): "
                         "its loss would be 0/0")
    return count


def for_backward(share, divisor: int):
    """The loss to call backward on: this part's share of the step's mean (its summed loss over
    the step's item count), times what the wrapper will divide its gradient by."""
    return share * divisor if divisor != 1 else share


def step_loss(shares: list, strategy):
    """The step's reported loss (a float, None on ranks without a loss): this rank's detached
    shares summed, then summed over the data-parallel ranks (a collective: call it outside
    the step timer, on every rank)."""
    if strategy.data_parallel_size == 1:
        return float(torch.stack(shares).sum().item()) if shares else None
    total = torch.stack(shares).sum().double()
    dist.all_reduce(total, group=strategy.data_parallel_group())
    return float(total.item())

"""One loss-scaling rule for gradient accumulation, for every strategy.

An optimizer step accumulates the gradients of n_micro micro-batches (grad_accum), and a
pipeline splits each of those into `pieces` pipeline micro-batches. Each piece's loss is
divided by n_micro x pieces before its backward, so the accumulated gradient is the gradient
of the step's mean loss, whatever the split. DeepSpeed's engine.backward and Accelerate's
accelerator.backward divide by their gradient_accumulation_steps themselves: those strategies
check that it equals n_micro and leave the loss alone (distlab.strategies.deepspeed, .accelerate).
"""
from __future__ import annotations


def accumulation_scaled(loss, n_micro: int, pieces: int = 1):
    """The loss to call backward on: this piece's share of the step's mean loss."""
    return loss / (pieces * n_micro)


def accumulation_unscaled(scaled_mean, n_micro: int, pieces: int = 1):
    """The plain mean loss back from the mean of scaled pieces (what the step reports)."""
    return scaled_mean * pieces * n_micro

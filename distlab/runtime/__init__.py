"""Runs inside a rank (a training rank under torchrun, accelerate launch or Ray Train, or a
checkpoint-validation rank): the worker and the one training loop, the model built, LoRA applied
and wrapped, loss scaling, clipping, the LR schedule, activation checkpointing, the
memory budget, what is reported between steps (monitor, trackers), held-out evaluation, what a
run measured, loading only what a rank holds, the streamed forward, unequal devices' batches and
the validation ranks' checks. These modules import torch and the training libraries; a few are
light and also read by the advisor (accumulation, activations' estimate).
"""

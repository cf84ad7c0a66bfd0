"""Runs inside a rank (a training rank under torchrun, accelerate launch or Ray Train, or a
checkpoint-validation rank): the kernels a rank is built from, below the checkpoints, the
strategies and the tasks that use them: loss scaling, clipping, the LR schedule, activation
checkpointing, the memory budget, trackers, held-out evaluation, loading only what a rank holds,
the streamed forward, unequal devices' batches. These modules import torch and the training
libraries; a few are light and also read by the advisor (accumulation, activations' estimate).
What drives them (the worker, the loop, the validation ranks) is distlab.rank.
"""

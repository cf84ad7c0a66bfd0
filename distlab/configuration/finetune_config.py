"""The fine-tuning keys of an experiment spec: how long a run is (steps, epochs or a token
budget), its learning-rate warm-up, and the checks that bind them (config time, light: no torch).

Layers: EXPERIMENT_DEFAULTS, then config `defaults:`, then the experiment. Keys of one group
(LENGTH_KEYS, LR_WARMUP_KEYS) are alternatives: the layer that sets one member replaces the
others it inherits (an experiment with `epochs: 3` drops the `steps` of `defaults:`), and a
layer that sets two is an error naming the field.
"""
from __future__ import annotations

import math
import warnings

from distlab.configuration.input_checks import ConfigError
from distlab.records.spec import Spec, SpecDraft, SpecFields
from distlab.configuration.strategies.settings import data_parallel

LENGTH_KEYS = ("steps", "epochs", "max_tokens")
LR_WARMUP_KEYS = ("lr_warmup_steps", "lr_warmup_ratio")
EXCLUSIVE = (LENGTH_KEYS, LR_WARMUP_KEYS)
# Old key -> new key, and what the old one meant, for the deprecation message.
RENAMED = {"warmup_steps": ("untimed_steps", "steps left out of the timing statistics, not the learning-rate "
                                             "warm-up (that is lr_warmup_steps)")}


class ConfigDeprecation(UserWarning):
    """A key that still works but has a new name (the message says what it means here)."""


def layer(keys: dict | None, where: str) -> dict:
    """One layer of experiment keys with renamed keys mapped to their new names (a
    deprecation warning says what the old one means) and each group of alternatives checked."""
    out = dict(keys or {})
    for old, (new, meaning) in RENAMED.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"config field '{where}.{old}': {old} is the old name of {new}; set only {new}")
        warnings.warn(ConfigDeprecation(
            f"config field '{where}.{old}' is deprecated: here it means {meaning}; it is now called {new} "
            f"(the old name keeps working for now)"), stacklevel=2)
        out[new] = out.pop(old)
    for group in EXCLUSIVE:
        given = [k for k in group if out.get(k) is not None]
        if len(given) > 1:
            raise ConfigError(f"config field '{where}.{given[1]}': {' and '.join(given)} are alternatives; "
                              f"set only one of {', '.join(group)}")
    return out


def over(base: dict, keys: dict) -> dict:
    """`base` with the members of each group `keys` sets cleared (so they do not stack)."""
    out = dict(base)
    for group in EXCLUSIVE:
        if any(keys.get(k) is not None for k in group):
            out.update({k: None for k in group})
    return out


def data_parallel_size(spec: SpecFields) -> int:
    """Ranks that read different samples: tensor- and pipeline-parallel ranks read the same ones."""
    return spec.world_size if data_parallel(spec) else 1


def resolve_length(spec: SpecFields, train_blocks: int | None = None) -> dict:
    """Fill spec.steps (optimizer steps) from epochs or max_tokens, and spec.length with how.

    max_tokens: steps = ceil(max_tokens / tokens per step), known from the spec alone.
    epochs: one epoch is what IndexStream draws per data-parallel rank before it reshuffles,
    floor(train_blocks / dp) // micro_batch micro-batches (DistributedSampler and the batches
    drop the remainder); steps = ceil(epochs x that / grad_accum), the Hugging Face Trainer's
    rounding: the last step may read into the next epoch. Needs the prepared data's block
    count (`train_blocks`); None leaves steps None until the data exists (rules/common.smk)."""
    dp = data_parallel_size(spec)
    tokens_per_step = spec.micro_batch * spec.grad_accum * dp * spec.seq_len
    if spec.max_tokens is not None:
        spec["steps"] = max(1, math.ceil(spec.max_tokens / tokens_per_step))
        spec["length"] = {"from": "max_tokens", "max_tokens": spec.max_tokens, "tokens_per_step": tokens_per_step,
                          "steps": spec.steps,
                          "how": "steps = ceil(max_tokens / (micro_batch x grad_accum x data-parallel ranks x "
                                 "seq_len)); tokens read, masked prompt tokens included"}
    elif spec.epochs is not None:
        if train_blocks is None:
            spec["steps"] = None
            spec["length"] = {"from": "epochs", "epochs": spec.epochs,
                              "how": "resolved to steps from the prepared data's train blocks once it exists"}
            return spec
        per_rank = train_blocks // dp if spec.sampler == "distributed" else train_blocks
        micro_per_epoch = per_rank // spec.micro_batch
        if micro_per_epoch < 1:
            raise ConfigError(f"{train_blocks} train blocks over {dp} data-parallel rank(s) do not fill one "
                              f"micro-batch of {spec.micro_batch}: an epoch would be empty")
        spec["steps"] = max(1, math.ceil(spec.epochs * micro_per_epoch / spec.grad_accum))
        spec["length"] = {"from": "epochs", "epochs": spec.epochs, "train_blocks": train_blocks,
                          "micro_batches_per_epoch_per_rank": micro_per_epoch,
                          "steps_per_epoch": micro_per_epoch / spec.grad_accum, "steps": spec.steps,
                          "tokens_per_step": tokens_per_step,
                          "how": "epoch = floor(train blocks / data-parallel ranks) // micro_batch micro-batches per "
                                 "rank; steps = ceil(epochs x that / grad_accum) (the last step may read into the "
                                 "next epoch)"}
    else:
        spec["length"] = {"from": "steps", "steps": spec.steps}
    if spec.lr_warmup_ratio is not None:
        spec["lr_warmup_steps"] = math.ceil(spec.lr_warmup_ratio * spec.steps)
    elif spec.lr_warmup_steps is None:
        spec["lr_warmup_steps"] = 0
    return spec


def resolve_epochs(spec: SpecFields, data_dir) -> dict:
    """An epochs experiment's spec with its steps from the prepared data (distlab_data.json's
    train blocks), checked like a steps experiment at config time; errors name the field."""
    import json
    from pathlib import Path

    blocks = json.loads((Path(data_dir) / "distlab_data.json").read_text())["splits"]["train"]["blocks"]

    def fail(field, message):
        raise ConfigError(f"config field '{field}' of experiment '{spec.id}' ({spec.epochs} epochs of "
                          f"{blocks} train blocks in {data_dir}): {message}")

    try:
        spec = resolve_length(SpecDraft(spec), blocks)
    except ConfigError as error:
        fail("epochs", str(error))
    check_length(spec, fail)
    return Spec(spec)


def check_length(spec: SpecFields, fail) -> None:
    """Checks that need the resolved steps (config time; for epochs once the data exists)."""
    steps = spec.steps
    if spec.untimed_steps >= steps:
        fail("untimed_steps", f"untimed steps ({spec.untimed_steps}) must be fewer than steps ({steps}) "
             "or no step is left to time")
    timed = steps - spec.untimed_steps
    if spec.repeats > 1 and timed < 2 * spec.repeats:
        fail("repeats", f"{spec.repeats} repeat windows need at least {2 * spec.repeats} timed steps "
             f"(steps - untimed_steps = {timed}); raise steps or lower repeats")
    if spec.lr_warmup_steps > steps:
        fail("lr_warmup_steps", f"learning-rate warm-up of {spec.lr_warmup_steps} steps is longer than the run "
             f"({steps} steps)")
    if spec.eval_every > steps:
        fail("eval_every", f"eval_every {spec.eval_every} is more than the run's {steps} steps: no eval point "
             "would fall inside it")


def check_finetune(spec: SpecFields, fail) -> None:
    """Relations between the fine-tuning keys that need no resolved length. (Activation
    checkpointing needs none: every strategy took it in the tests, the model's support is
    checked when it loads, distlab.runtime.activations.enable_checkpointing.)"""
    if spec.checkpoint_select == "best" and not spec.eval_every:
        fail("checkpoint_select", "best needs held-out evaluations during training to choose from; set eval_every")

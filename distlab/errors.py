"""The exceptions raised on one side of a seam and caught on the other, in a module that
imports nothing: config checks (input_checks, model_files, data_checks, tokenizer_checks,
config) and checkpoints (checkpoint, trainer_state) raise them without importing each other,
so no import cycle runs through an exception class (tests/test_import_cycles.py). The modules
that raised them first still export them (distlab.configuration.config.ConfigError, distlab.checkpoints.checkpoint.*).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A config problem, with the offending field (and file) named in the message."""


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded; the message says why and names the file or field."""


class CheckpointCorrupt(CheckpointError):
    """A file is missing, truncated or altered (the manifest names it)."""


class CheckpointMismatch(CheckpointError):
    """Made for another model, config or world size."""


class BaseMismatch(CheckpointMismatch):
    """LoRA adapters saved for another base model than this run's."""


class FidelityError(RuntimeError):
    """The run is not what its spec says (wrong wrapper, world size, device): strategies, model
    setup and tasks raise it (distlab.strategies.base exports it too)."""

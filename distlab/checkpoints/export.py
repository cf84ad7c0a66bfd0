"""The final save's export: one collective pass over the trained state, gathered one decoder
layer at a time (Strategy.state_groups), in which rank 0 writes the Hugging Face export and
computes the logits every later check compares against (distlab.runtime.streamed: CPU, fp32).

What is written (spec `export`):
- full fine-tuning: export/ = the model as `save_pretrained(max_shard_size=...)` lays it out
  (safetensors shards + model.safetensors.index.json, or one model.safetensors), config and
  tokenizer, written tensor by tensor (distlab.records.export_files).
- LoRA: export/ = the PEFT adapter folder (`PeftModel.save_pretrained`: adapter_config.json,
  adapter_model.safetensors; loads with `PeftModel.from_pretrained(base, export)`) and the
  tokenizer; with `export: {merge: true}` also export/merged/, the base with the adapters
  merged into it, written like a full export, one layer at a time.
- eval_logits.safetensors: `logits`, the streamed CPU fp32 forward of the gathered state on the
  fixed eval batch (EVAL_BATCH sequences, their first EVAL_TOKENS tokens: a causal model's
  logits there depend on those tokens only, and the file stays small for a large vocabulary),
  and `training_logits`, the training model's own forward on the same batch (still sharded, on
  its device, in training precision): their difference says the gathered weights are the model
  that trained.
"""
from __future__ import annotations

import time
from pathlib import Path

from distlab.records.spec import Spec
from distlab.configuration.training_tools import adapts
from distlab.records.job import Job

EVAL_BATCH = 2  # sequences of the eval split the recorded logits are computed on
EVAL_TOKENS = 32  # their first tokens
MERGED = "merged"
DEFAULTS = {"merge": False, "max_shard_size": "5GB"}
# Fault-injection hook for tests: "<experiment id>" makes rank 0's export raise (a failed save);
# "<experiment id>:oom" ends rank 0 there as the memory watchdog would (distlab.runtime.memory).
SAVE_FAULT_ENV = "DISTLAB_FAULT_SAVE"


def eval_batch(data_dir):
    from distlab.data_prep.data import load_blocks

    return load_blocks(data_dir, "eval")[:EVAL_BATCH, :EVAL_TOKENS]


def settings(spec: Spec) -> dict:
    return {**DEFAULTS, **(spec.export or {})}


def save_tokenizer(model_source: str, folder: Path) -> str:
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_source).save_pretrained(str(folder))
        return "saved"
    except Exception as exc:  # recorded: the export then needs the user's own tokenizer
        return f"not saved: no tokenizer loadable from {model_source} ({exc})"


class FullWeights:
    """Every streamed tensor into a save_pretrained layout (shards + index), as fp32."""

    def __init__(self, model, folder: Path, max_shard_size, rename=None):
        import torch

        from distlab.records.export_files import ShardedWriter, save_hf_metadata, shard_plan

        folder.mkdir(parents=True, exist_ok=True)
        save_hf_metadata(model, folder, torch.float32)
        self.writer = ShardedWriter(folder, shard_plan(model, max_shard_size))
        self.rename = rename or (lambda name: name)

    def add(self, skeleton, group: dict) -> None:
        for name, value in group.items():
            target = self.rename(name)
            if target is not None and self.writer.wants(target):
                self.writer.write(target, value.float() if value.is_floating_point() else value)

    def close(self, skeleton=None) -> None:
        self.writer.close()


class MergedWeights(FullWeights):
    """LoRA merged into the base, layer by layer: each adapted weight W + peft's own delta
    (LoraLayer.get_delta_weight: B @ A x scaling) under the base model's names."""

    def __init__(self, source: str, folder: Path, max_shard_size):
        from distlab.runtime.model import load_model

        base = load_model(source, device="meta")
        if getattr(base.config, "tie_word_embeddings", False):
            base.tie_weights()
        super().__init__(base, folder, max_shard_size)

    def add(self, skeleton, group: dict) -> None:
        from distlab.runtime.lora import base_name

        for name, value in group.items():
            if "lora_" in name:
                continue
            value = value.float()
            if name.endswith(".base_layer.weight"):
                layer = skeleton.model.get_submodule(name.removesuffix(".base_layer.weight"))
                value = value + layer.get_delta_weight("default").float()
            target = base_name(name)
            if self.writer.wants(target):
                self.writer.write(target, value)


class AdapterWeights:
    """The LoRA adapters, kept (they are small) and written by peft's own save_pretrained."""

    def __init__(self, folder: Path):
        self.folder, self.adapters = folder, {}

    def add(self, skeleton, group: dict) -> None:
        for name, value in group.items():
            if "lora_" in name:
                self.adapters[name] = value.float().clone()

    def close(self, skeleton) -> None:
        skeleton.model.save_pretrained(str(self.folder), state_dict=self.adapters, safe_serialization=True)


def write_export(skeleton, groups, job: Job, spec: Spec, folder: Path, batch, training_logits) -> dict:
    """Rank 0: consume the collective `groups` into the export under `folder` while the
    streamed forward computes the recorded logits; returns what was written."""
    import os

    from safetensors.torch import save_file

    from distlab.runtime.streamed import streamed_logits

    fault = os.environ.get(SAVE_FAULT_ENV, "")
    if fault == spec.id:
        raise RuntimeError(f"{SAVE_FAULT_ENV}: injected failure of the final save's export")
    if fault == f"{spec.id}:oom":
        from distlab.runtime.memory import OOM_EXIT_CODE, record_oom

        record_oom(job.run_dir, MemoryError(f"{SAVE_FAULT_ENV}: injected out-of-memory in the final save's export"))
        os._exit(OOM_EXIT_CODE)
    opts, source = settings(spec), job.model_source
    export = folder / "export"
    info = {"layout": [], "max_shard_size": opts["max_shard_size"], "base_weights_dtype": None}
    base_dtypes = set()
    if adapts(spec):
        sinks = [AdapterWeights(export)]
        info["layout"].append("PEFT adapter folder (PeftModel.save_pretrained)")
        if opts["merge"]:
            sinks.append(MergedWeights(source, export / MERGED, opts["max_shard_size"]))
            info["layout"].append(f"{MERGED}/: base with the adapters merged, save_pretrained shards + index")
    else:
        sinks = [FullWeights(skeleton.model, export, opts["max_shard_size"])]
        info["layout"].append("save_pretrained shards + index")

    def on_group(sk, group):
        base_dtypes.update(str(v.dtype).removeprefix("torch.") for n, v in group.items() if "lora_" not in n)
        for sink in sinks:
            sink.add(sk, group)

    logits = streamed_logits(skeleton, groups, batch, on_group=on_group)
    for sink in sinks:
        sink.close(skeleton)
    info["tokenizer"] = save_tokenizer(source, export)
    if adapts(spec) and opts["merge"]:
        save_tokenizer(source, export / MERGED)
    info["base_weights_dtype"] = sorted(base_dtypes)[0] if len(base_dtypes) == 1 else sorted(base_dtypes)
    recorded = {"logits": logits.contiguous()}
    if training_logits is not None:
        trained = training_logits.detach().float().cpu().contiguous()
        recorded["training_logits"] = trained
        info["training_vs_streamed_max_abs_logit_diff"] = (trained - logits).abs().max().item()
    save_file(recorded, str(folder / "eval_logits.safetensors"))
    info["lora_adapter"] = adapts(spec)
    return info


def export_pass(strategy, job: Job, spec: Spec, folder: Path) -> tuple[dict | None, str | None]:
    """Collective: the training model's own logits, then one pass of strategy.state_groups()
    that rank 0 turns into the export and the recorded logits. Every rank drains the groups
    even when rank 0's part failed, so no peer is left in a gather. Returns (info on rank 0,
    rank 0's error or None)."""
    import torch.distributed as dist

    from distlab.runtime.memory import is_out_of_memory
    from distlab.runtime.qlora import trained_groups
    from distlab.runtime.streamed import Skeleton

    started = time.perf_counter()
    batch = eval_batch(job.data_dir)
    training_logits = strategy.forward_logits(batch)
    groups = trained_groups(strategy, spec, job.model_source)  # QLoRA: its adapters on the full-precision base
    info, error = None, None
    if dist.get_rank() == 0:
        try:
            skeleton = Skeleton.for_run(job.model_source, spec)
            info = write_export(skeleton, groups, job, spec, folder, batch, training_logits)
            info["seconds"] = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank in checkpoint.save_checkpoint
            if is_out_of_memory(exc):
                raise
            error = f"{type(exc).__name__}: {exc}"[:1000]
    for _ in groups:  # what rank 0 did not consume (all of it on the other ranks)
        pass
    return info, error

"""Checkpoints users can trust: the strategy's native state, the trainer state and a
consolidated Hugging Face export, written atomically with a manifest (distlab.checkpoint_files).

One checkpoint folder:
    state/                          the strategy's native format (strategy.save_checkpoint)
    trainer/rank<R>.json            steps done, data position, Python/NumPy RNG, LR schedule, records so far
    trainer/rng-rank<R>.safetensors torch CPU (and CUDA) RNG state
    distlab_checkpoint.json         what made it: experiment, strategy, world size, spec, model signature
    eval_logits.safetensors         (final only) logits of the consolidated model on a fixed eval batch
    export/                         (final only) save_pretrained folder + tokenizer; LoRA: merged model,
                                    and the adapters in export/adapter/
    MANIFEST.json                   every other file with its size and sha256, written last

Where checkpoints live, under results/<machine>/<experiment>/:
    checkpoint/final/     the declared Snakemake output, saved when training ends
    checkpoint/step-<N>/  the mid-run checkpoint validation resumes from (N = steps - PARITY_STEPS)
    resume/step-<K>/      checkpoints saved while training runs (every checkpoint_every steps, and
                          step N). Deliberately NOT a declared output: Snakemake deletes a failed
                          job's outputs, and these must survive a killed job so the rerun resumes
                          from them. Removed when the job ends; step N moves into checkpoint/.

Loading never unpickles arbitrary objects: tensors come from safetensors or
torch.load(weights_only=True), everything else is JSON; the libraries' own loaders (DeepSpeed,
DCP, Accelerate) run inside distlab.safe_load.weights_only_loads, which forces the same.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from distlab.checkpoint_files import (FORMAT_VERSION, atomic_dir, dir_bytes, fsync_tree, replace_dir, verify_manifest,
                                      write_manifest)
from distlab.safe_load import weights_only_loads
from distlab.trainer_state import restore_trainer_state as _restore_trainer_state
from distlab.trainer_state import save_trainer_state as _save_trainer_state

# torch is imported inside the functions that need it: the validation driver (one Snakemake
# job per experiment) reads manifests and metadata without paying torch's import time.

META = "distlab_checkpoint.json"
PARITY_STEPS = 2  # steps validation re-runs from the mid-run checkpoint
EVAL_BATCH = 2  # sequences of the eval split the recorded logits are computed on
# Spec fields that leave the training trajectory unchanged: a checkpoint stays valid across them.
NON_TRAJECTORY_FIELDS = ("id", "stage", "checkpoint_every", "memory_budget_gib", "untimed_steps", "repeats",
                         "progress_every_s", "tracking", "eval_every", "checkpoint_select")
# Fault-injection hook for tests: "<experiment id>:<rank>:<steps done>" SIGKILLs that rank
# right after that step (and after any checkpoint saved at it).
FAULT_ENV = "DISTLAB_FAULT_KILL"


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded; the message says why and names the file or field."""


class CheckpointCorrupt(CheckpointError):
    """A file is missing, truncated or altered (the manifest names it)."""


class CheckpointMismatch(CheckpointError):
    """Made for another model, config or world size."""


# -- files --------------------------------------------------------------------------------
def check_manifest(root) -> None:
    problems = verify_manifest(root)
    if problems:
        raise CheckpointCorrupt(f"checkpoint {root} failed its manifest check: " + "; ".join(problems))


# -- the plain format (strategies whose every rank holds the whole model) -------------------
def save_plain(strategy, path: str) -> None:
    """Rank 0 writes the model (safetensors) and the optimizer state; others wait."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_model

    if dist.get_rank() == 0:
        tmp, commit = atomic_dir(path)
        save_model(strategy.unwrapped(), str(tmp / "model.safetensors"))
        torch.save(strategy.optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "format.json").write_text(json.dumps({"format": "plain", "strategy": strategy.name}))
        commit()
    dist.barrier()


def load_plain(strategy, path: str) -> None:
    """Every rank reads the same files; the format does not depend on the world size."""
    import torch
    from safetensors.torch import load_model

    path = Path(path)
    load_model(strategy.unwrapped(), str(path / "model.safetensors"))
    state = torch.load(path / "optimizer.pt", weights_only=True)
    strategy.optimizer.load_state_dict(state)


# -- identity: refuse a checkpoint of another model or config -------------------------------
def model_signature(model) -> dict:
    """Config and parameter shapes of the (LoRA-applied) model, taken before any wrapper
    shards it."""
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")}
    return {"config": json.loads(json.dumps(config, default=str)),
            # ds_shape: a ZeRO-3 parameter partitioned at load (deepspeed.zero.Init) has shape [0].
            "parameters": {n: list(getattr(p, "ds_shape", None) or p.shape) for n, p in model.named_parameters()}}


def spec_fingerprint(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k not in NON_TRAJECTORY_FIELDS}


def _differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a!r} (checkpoint) vs {b!r} (this run)")
    return out


def check_compatible(meta: dict, spec: dict, signature: dict, where, allow_world_size: bool = False) -> None:
    """Raise CheckpointMismatch naming what differs: model config, parameter shapes or spec field."""
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatch(f"checkpoint {where}: format_version {meta.get('format_version')!r}, this "
                                 f"distlab reads {FORMAT_VERSION}")
    model = _differences(meta["model"]["config"], signature["config"], "config.")
    model += _differences(meta["model"]["parameters"], signature["parameters"], "parameter ")
    if model:
        raise CheckpointMismatch(f"checkpoint {where} was made from a different model; refusing to load it: "
                                 + "; ".join(model[:5]) + (f" (+{len(model) - 5} more)" if len(model) > 5 else ""))
    saved, now = dict(meta["spec"]), spec_fingerprint(spec)
    if allow_world_size:
        saved.pop("world_size", None)
        now.pop("world_size", None)
    config = _differences(saved, now, "field ")
    if config:
        raise CheckpointMismatch(f"checkpoint {where} was made with a different experiment config; refusing to "
                                 "load it: " + "; ".join(config))


def read_meta(root) -> dict:
    path = Path(root) / META
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path}: missing or unreadable ({exc})") from None


# -- the consolidated export ----------------------------------------------------------------------
def eval_batch(data_dir) -> torch.Tensor:
    from distlab.data import load_blocks

    return load_blocks(data_dir, "eval")[:EVAL_BATCH]


def consolidated_model(full_state: dict, model_source: str, spec: dict):
    """A plain Hugging Face model (PeftModel for LoRA) holding the strategy's full state."""
    from distlab.lora import apply_lora
    from distlab.model import load_model

    if spec["method"] == "full":
        # Full fine-tuning: the architecture on meta, the gathered tensors assigned as its
        # parameters (fp32, as the copying path keeps them), so rank 0 holds one whole-model
        # copy, not two (a per-rank memory budget counts it).
        model = load_model(model_source, device="meta")
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in full_state.items()},
                              strict=True, assign=True)
        if model.config.tie_word_embeddings:
            model.tie_weights()
        return model.eval()
    model = load_model(model_source)
    if spec["method"] == "lora":
        model, _ = apply_lora(model, spec["lora"], spec["seed"])
    model.load_state_dict(full_state, strict=True)
    return model.eval()


def logits_of(model, batch: torch.Tensor) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return model(input_ids=batch).logits.float()


def write_export(model, model_source: str, spec: dict, folder: Path) -> dict:
    """save_pretrained (safetensors) + tokenizer; LoRA: adapters in adapter/, merged model at top."""
    if spec["method"] == "lora":
        model.save_pretrained(str(folder / "adapter"))
        model = model.merge_and_unload()
    model.save_pretrained(str(folder), safe_serialization=True)
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_source).save_pretrained(str(folder))
        tokenizer = "saved"
    except Exception as exc:  # recorded: the export then needs the user's own tokenizer
        tokenizer = f"not saved: no tokenizer loadable from {model_source} ({exc})"
    return {"tokenizer": tokenizer, "lora_adapter": spec["method"] == "lora"}


# -- the collective save and load ----------------------------------------------------------------
def save_checkpoint(dest, strategy, ctx, job: dict, signature: dict, steps_done: int, stream, records,
                    export: bool = False) -> dict:
    """Collective. Native state + trainer state (+ eval logits and export), then manifest and
    an atomic rename. Returns timings (meaningful on rank 0)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    t0 = time.perf_counter()
    strategy.save_checkpoint(str(tmp / "state"))
    dist.barrier()
    info = {"steps_done": steps_done, "save_seconds": time.perf_counter() - t0,
            "how": "strategy.save_checkpoint wall time on rank 0, up to the barrier after it"}
    _save_trainer_state(tmp, rank, ctx.device, steps_done, stream, records, scheduler=strategy.scheduler)
    if export:
        t0 = time.perf_counter()
        try:
            full = strategy.full_state_dict()
        except NotImplementedError as exc:  # every rank raises alike: the native state still counts
            full, info["export"] = None, {"status": "unsupported", "reason": str(exc)}
        if rank == 0 and full is not None:
            model = consolidated_model(full, job["model_source"], ctx.spec)
            save_file({"logits": logits_of(model, eval_batch(job["data_dir"])).contiguous()},
                      str(tmp / "eval_logits.safetensors"))
            info["export"] = write_export(model, job["model_source"], ctx.spec, tmp / "export")
            info["export_seconds"] = time.perf_counter() - t0
        del full
    dist.barrier()
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "experiment": ctx.spec["id"], "strategy": strategy.name,
                "world_size": dist.get_world_size(), "steps_done": steps_done,
                "spec": spec_fingerprint(ctx.spec), "model": signature, "save": info}
        (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
        write_manifest(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, dest)
        info["bytes"] = dir_bytes(dest)
    dist.barrier()
    return info


def load_checkpoint(src, strategy, ctx, signature: dict, stream=None, verify: bool = True,
                    allow_world_size: bool = False) -> dict:
    """Collective. Check manifest and identity, load the native state, then (when `stream` is
    given and the world size is the saved one) the trainer state. Returns steps_done, records
    and load seconds."""
    import torch.distributed as dist

    src = Path(src)
    if verify:
        check_manifest(src)
    meta = read_meta(src)
    check_compatible(meta, ctx.spec, signature, src, allow_world_size=allow_world_size)
    if stream is not None and meta["world_size"] != dist.get_world_size():
        raise CheckpointMismatch(f"checkpoint {src}: trainer state is per rank of a world of "
                                 f"{meta['world_size']}; this run has {dist.get_world_size()}")
    dist.barrier()
    t0 = time.perf_counter()
    with weights_only_loads():  # DeepSpeed's and DCP's own loaders would unpickle anything
        strategy.load_checkpoint(str(src / "state"))
    dist.barrier()
    out = {"load_seconds": time.perf_counter() - t0, "steps_done": meta["steps_done"], "records": [],
           "saved_world_size": meta["world_size"]}
    if stream is not None:
        out["steps_done"], out["records"] = _restore_trainer_state(src, dist.get_rank(), ctx.device, stream,
                                                                   scheduler=strategy.scheduler)
    return out


def maybe_inject_fault(spec: dict, steps_done: int) -> None:
    """Test hook (FAULT_ENV): SIGKILL this rank, as a crashed node would die."""
    import torch.distributed as dist

    target = os.environ.get(FAULT_ENV)
    if not target:
        return
    experiment, rank, step = target.rsplit(":", 2)
    if experiment == spec["id"] and int(rank) == dist.get_rank() and int(step) == steps_done:
        print(f"{FAULT_ENV}: killing rank {rank} after step {steps_done}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


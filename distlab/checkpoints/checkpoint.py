"""Checkpoints users can trust: the strategy's native state, the trainer state and a
Hugging Face export, written atomically with a manifest (distlab.records.checkpoint_files).

One checkpoint folder:
    state/                          the strategy's native format (strategy.save_checkpoint; the formats
                                    are distlab.checkpoint_formats): each rank's part of the trainable
                                    parameters and optimizer state (LoRA: the adapters only)
    trainer/rank<R>.json            steps done, data position, Python/NumPy RNG, LR schedule, records so far
    trainer/rng-rank<R>.safetensors torch CPU (and CUDA) RNG state
    distlab_checkpoint.json         what made it: experiment, strategy, world size, spec, model signature;
                                    LoRA: the frozen base by identity (folder, sha256 of its weight files)
    eval_logits.safetensors         (final only) the trained state's output on the task's fixed batch
                                    (causal LM: streamed CPU logits of a fixed eval batch, and the
                                    training model's own; distlab.checkpoints.export)
    export/                         (final only) the task's export (causal LM: save_pretrained shards +
                                    index + tokenizer; LoRA: the PEFT adapter folder, export/merged/
                                    with export.merge; text-to-image: diffusers' LoRA file)
    MANIFEST.json                   every other file with its size and sha256, written last

Where checkpoints live, under results/<machine>/<experiment>/:
    checkpoint/final/     the declared Snakemake output, saved when training ends
    checkpoint/step-<N>/  the mid-run checkpoint validation resumes from (N = steps - PARITY_STEPS)
    resume/step-<K>/      checkpoints saved while training runs (every checkpoint_every steps, and
                          step N). Deliberately NOT a declared output: Snakemake deletes a failed
                          job's outputs, and these must survive a killed job so the rerun resumes
                          from them. Removed when the job ends; step N moves into checkpoint/.
    refused-checkpoints/  resume checkpoints a launch refused, moved here with the reason, never
                          deleted by distlab (distlab.rank.training_checkpoints.set_aside).

Loading never unpickles arbitrary objects: tensors come from safetensors or
torch.load(weights_only=True), everything else is JSON; the libraries' own loaders (DeepSpeed,
DCP, Accelerate) run inside distlab.checkpoints.safe_load.weights_only_loads, which forces the same.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from distlab.records.spec import Spec
from distlab.records.checkpoint_files import (FORMAT_VERSION, META, dir_bytes, fsync_tree, read_meta,  # noqa: F401
                                             replace_dir, verify_manifest, write_manifest)
from distlab.errors import BaseMismatch, CheckpointCorrupt, CheckpointError, CheckpointMismatch
from distlab.records.job import Job
from distlab.checkpoints.safe_load import weights_only_loads
from distlab.launchers.environment import FAULT_ENV
from distlab.checkpoints.trainer_state import restore_trainer_state as _restore_trainer_state
from distlab.checkpoints.trainer_state import save_trainer_state as _save_trainer_state

# torch is imported inside the functions that need it: the validation driver (one Snakemake
# job per experiment) reads manifests and metadata without paying torch's import time.

PARITY_STEPS = 2  # steps validation re-runs from the mid-run checkpoint
# Spec fields that leave the training trajectory unchanged: a checkpoint stays valid across them.
NON_TRAJECTORY_FIELDS = ("id", "stage", "checkpoint_every", "checkpoint_keep", "export", "memory_budget_gib",
                         "untimed_steps", "repeats", "launches", "progress_every_s", "tracking", "eval_every",
                         "checkpoint_select", "profile")


class SaveFailed(RuntimeError):
    """A save that did not complete; every rank raises it alike (agree), naming each rank's error."""


def agree(error: str | None, what: str) -> None:
    """Collective: raise SaveFailed on every rank when any rank reports an error."""
    import torch.distributed as dist

    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {rank}: {text}" for rank, text in enumerate(errors) if text]
    if failed:
        raise SaveFailed(f"{what} failed: " + "; ".join(failed))


def rank_error(work) -> str | None:
    """Run this rank's part of a save; its error as text (an allocation failure is re-raised:
    distlab.runtime.memory records it as the run's oom; so is a SaveFailed, which every rank
    raised alike inside `work`)."""
    from distlab.runtime.memory import is_out_of_memory

    try:
        work()
    except SaveFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank (agree)
        if is_out_of_memory(exc):
            raise
        return f"{type(exc).__name__}: {exc}"[:1000]
    return None


def on_every_rank(work, what: str) -> None:
    """Collective: run this rank's part of a save (`work`, None for a rank with nothing to do),
    then agree on it. It stands where a save would call dist.barrier(): the barrier outside the
    error-catching closure, so a rank whose write failed reaches the same collective as the
    others, and every rank raises the same SaveFailed (a bare barrier after a failed write would
    leave the others waiting in it while the failed rank waits in agree's all_gather)."""
    agree(rank_error(work) if work is not None else None, what)


# -- files --------------------------------------------------------------------------------
def check_manifest(root) -> None:
    problems = verify_manifest(root)
    if problems:
        raise CheckpointCorrupt(f"checkpoint {root} failed its manifest check: " + "; ".join(problems))


# -- identity: refuse a checkpoint of another model or config -------------------------------
def model_signature(model) -> dict:
    """Config and parameter shapes of the (LoRA-applied) model, taken before any wrapper
    shards it."""
    # A transformers config has to_dict(); a diffusers model's config is a (frozen) dict.
    raw = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
    config = {k: v for k, v in raw.items()
              if k not in ("_name_or_path", "transformers_version", "_diffusers_version", "dtype", "torch_dtype")}
    return {"config": json.loads(json.dumps(config, default=str)),
            # ds_shape: a ZeRO-3 parameter partitioned at load (deepspeed.zero.Init) has shape [0].
            "parameters": {n: list(getattr(p, "ds_shape", None) or p.shape) for n, p in model.named_parameters()}}


def base_identity(model_source: str, weights_folder: str | None = None) -> dict:
    """The frozen base a LoRA checkpoint's adapters belong to: its folder (or hub id) and the
    sha256 of every weight file of the trained module (`weights_folder`, the task's; default
    the model folder itself) (a LoRA checkpoint does not hold the base's weights).
    Collective where a process group exists: rank 0 reads the files, the others receive it."""
    import torch.distributed as dist

    from distlab.records.checkpoint_files import sha256_file
    from distlab.runtime.partial_load import model_folder

    out = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        folder = model_folder(weights_folder or model_source)
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
        out[0] = {"source": str(model_source), "weights_sha256": {p.name: sha256_file(p) for p in files},
                  "how": "sha256 of every *.safetensors / *.bin file of the folder"}
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)
    return out[0]


def check_base(meta: dict, base: dict | None, where) -> None:
    """Refuse LoRA adapters saved for another base model, naming both."""
    saved = meta.get("base_model")
    if saved is None or base is None or saved["weights_sha256"] == base["weights_sha256"]:
        return

    def named(identity):
        digests = ", ".join(f"{name} {digest[:12]}" for name, digest in sorted(identity["weights_sha256"].items()))
        return f"{identity['source']} ({digests or 'no weight files'})"

    raise BaseMismatch(f"checkpoint {where} holds LoRA adapters trained on the base model {named(saved)}; "
                             f"this run's base is {named(base)}: refusing to load them onto another base")


def spec_fingerprint(spec: Spec) -> dict:
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


def check_compatible(meta: dict, spec: Spec, signature: dict, where, allow_world_size: bool = False) -> None:
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


# -- the collective save and load ----------------------------------------------------------------
def save_checkpoint(dest, strategy, ctx, job: Job, signature: dict, steps_done: int, stream, records,
                    export: bool = False, base: dict | None = None) -> dict:
    """Collective. Native state + trainer state (+ the export and recorded logits: distlab.checkpoints.export),
    then manifest and an atomic rename. A part that fails on any rank fails it on all of them
    (SaveFailed, nothing left at `dest`). `base`: a LoRA run's base_identity. Returns timings
    (meaningful on rank 0)."""
    import torch.distributed as dist

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        t0 = time.perf_counter()
        agree(rank_error(lambda: strategy.save_checkpoint(str(tmp / "state"))), "the native state's save")
        dist.barrier()
        info = {"steps_done": steps_done, "save_seconds": time.perf_counter() - t0,
                "how": "strategy.save_checkpoint wall time on rank 0, up to the barrier after it"}
        agree(rank_error(lambda: _save_trainer_state(tmp, rank, ctx.device, steps_done, stream, records,
                                                     scheduler=strategy.scheduler)), "the trainer state's save")
        if export:
            t0 = time.perf_counter()
            info["export"], error = strategy.task.export_pass(strategy, job, ctx.spec, tmp)
            agree(error, "the export")
            info["export_seconds"] = time.perf_counter() - t0

        def finish():
            meta = {"format_version": FORMAT_VERSION, "experiment": ctx.spec.id, "strategy": strategy.name,
                    "world_size": dist.get_world_size(), "steps_done": steps_done,
                    "spec": spec_fingerprint(ctx.spec), "model": signature, "save": info}
            if base is not None:
                meta["base_model"] = base
            (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
            write_manifest(tmp)
            fsync_tree(tmp)
            replace_dir(tmp, dest)
            info["bytes"] = dir_bytes(dest)

        agree(rank_error(finish) if rank == 0 else None, "the manifest and rename")
    except SaveFailed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def check_loadable(src, spec: Spec, signature: dict, verify: bool = True, allow_world_size: bool = False,
                   base: dict | None = None, trainer_world_size: int | None = None) -> dict:
    """The checks load_checkpoint makes before it changes any state: manifest, identity (LoRA:
    `base`, this run's base_identity, against the one saved) and, for the trainer state, the
    world size it was saved at. Returns the checkpoint's metadata; every refusal is a
    CheckpointError (a metadata file of another shape too, not a KeyError)."""
    src = Path(src)
    if verify:
        check_manifest(src)
    meta = read_meta(src)
    try:
        check_compatible(meta, spec, signature, src, allow_world_size=allow_world_size)
        check_base(meta, base, src)
        saved_world = meta["world_size"]
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointCorrupt(f"{src / META}: not the metadata of a distlab checkpoint "
                                f"({type(exc).__name__}: {exc})") from None
    if trainer_world_size is not None and saved_world != trainer_world_size:
        raise CheckpointMismatch(f"checkpoint {src}: trainer state is per rank of a world of "
                                 f"{saved_world}; this run has {trainer_world_size}")
    return meta


def load_checkpoint(src, strategy, ctx, signature: dict, stream=None, verify: bool = True,
                    allow_world_size: bool = False, base: dict | None = None) -> dict:
    """Collective. check_loadable, then load the native state, then (when `stream` is given and
    the world size is the saved one) the trainer state. Returns steps_done, records and load seconds."""
    import torch.distributed as dist

    src = Path(src)
    meta = check_loadable(src, ctx.spec, signature, verify, allow_world_size, base,
                          dist.get_world_size() if stream is not None else None)
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


def maybe_inject_fault(spec: Spec, steps_done: int) -> None:
    """Test hook (FAULT_ENV): SIGKILL this rank, as a crashed node would die."""
    import torch.distributed as dist

    target = os.environ.get(FAULT_ENV)
    if not target:
        return
    experiment, rank, step = target.rsplit(":", 2)
    if experiment == spec.id and int(rank) == dist.get_rank() and int(step) == steps_done:
        print(f"{FAULT_ENV}: killing rank {rank} after step {steps_done}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


"""The causal LM's outputs in a validation rank (distlab.rank.validate_ranks calls them through the
task: distlab.tasks.causal_lm; text-to-image's are distlab/tasks/text_to_image/outputs.py):
the export checked as a user opens it, a reloaded strategy's output on the fixed eval batch,
and the LoRA base check.

Every logit is computed the way the recorded ones were (distlab.runtime.streamed: on rank 0's CPU in
fp32, the weights arriving one decoder layer at a time): from a reloaded strategy's gathered
state, or from the export's files. No process holds a whole model.
"""
from __future__ import annotations

from pathlib import Path

from distlab.configuration.training_tools import adapts
from distlab.records.validation import FAILED, MERGE_TOLERANCE, PASSED, RELOAD_TOLERANCE


def export_logits(folder: Path, batch, skeleton=None, base_folder=None, cast=None):
    """Streamed CPU logits of a Hugging Face folder as a user would load it: its own config.json
    and weight files, one layer at a time. LoRA: `skeleton` is the PeftModel peft built on a
    meta base from the adapter folder, the base weights read from `base_folder`."""
    from distlab.runtime.model import load_model
    from distlab.configuration.model_files import checkpoint_names
    from distlab.runtime.streamed import Skeleton, file_groups, open_weights, streamed_logits

    if skeleton is None:
        skeleton = Skeleton(load_model(str(folder), device="meta"))
        with open_weights(folder) as reader:
            return streamed_logits(skeleton, file_groups(skeleton, reader, cast=cast), batch)
    from distlab.records.export_files import weight_index
    from distlab.runtime.lora import base_name

    base = skeleton.model.get_base_model()
    stored = checkpoint_names(base, weight_index(base_folder))
    keys = {name: stored[base_name(name)] for name in skeleton.shapes if "lora_" not in name}
    with open_weights(base_folder, keys) as reader:
        return streamed_logits(skeleton, file_groups(skeleton, reader, cast=cast,
                                                     select=lambda n: "lora_" not in n), batch)


def adapter_skeleton(folder: Path, source: str):
    """The base on the meta device with the adapter folder applied by peft (its config reader and
    weight loader): the adapters real and in place, the base weights to be streamed. Every
    adapter of the model must be in the file and every tensor of the file an adapter."""
    import torch
    from peft import PeftConfig, get_peft_model
    from peft.utils import load_peft_weights

    from distlab.runtime.model import load_model
    from distlab.runtime.streamed import Skeleton

    config = PeftConfig.from_pretrained(str(folder))
    with torch.random.fork_rng(devices=[]):
        skeleton = Skeleton(get_peft_model(load_model(source, device="meta"), config))
    stored = load_peft_weights(str(folder))
    # peft stores each adapter without its adapter name ("lora_A.default.weight" -> "lora_A.weight").
    wanted = {name: name.replace(".default.", ".", 1) for name in skeleton.shapes if "lora_" in name}
    missing = sorted(k for k in wanted.values() if k not in stored)
    unexpected = sorted(set(stored) - set(wanted.values()))
    if missing or unexpected:
        raise ValueError(f"{folder}: adapter file and model disagree: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}")
    skeleton.place({name: stored[key].float() for name, key in wanted.items()})
    skeleton.fixed |= set(wanted)
    skeleton.resident -= set(wanted)  # never released by the streamed forward
    return skeleton


def export_layout(folder: Path) -> dict:
    """The export's weight files against what save_pretrained writes for its own config."""
    from distlab.records.export_files import shard_plan, weight_index
    from distlab.runtime.model import load_model

    plan = shard_plan(load_model(str(folder), device="meta"))
    wanted = {name: file for file, entries in plan["files"].items() for name in entries}
    found = weight_index(folder)
    return {"files_as_save_pretrained": found == wanted,
            "missing": sorted(set(wanted) - set(found))[:5], "unexpected": sorted(set(found) - set(wanted))[:5],
            "files": sorted(set(found.values()))}


def check_export(validator) -> dict:
    """Rank 0, before loading anything else: the export as a user would open it (its config,
    its files; LoRA: peft's PeftModel.from_pretrained on the base), run streamed, vs the
    logits recorded at save time."""
    import torch

    from distlab.checkpoints import checkpoint as ckpt
    from distlab.checkpoints.export import MERGED, eval_batch
    from distlab.runtime.partial_load import model_folder

    final = Path(validator.job.final)
    folder = final / "export"
    meta = ckpt.read_meta(final)
    if not folder.is_dir():
        raise NotImplementedError((meta["save"].get("export") or {}).get("reason", "no export was written"))
    saved_export = meta["save"].get("export") or {}
    batch, saved = eval_batch(validator.job.data_dir), validator.saved_logits()
    spec, source = validator.spec, validator.job.model_source
    out = {"path": str(folder), "tolerance": RELOAD_TOLERANCE,
           "how": "the export's own files read one decoder layer at a time and run on the CPU in fp32 (no process "
                  "holds the whole model); logits on the fixed eval batch vs those recorded at save time"}
    if adapts(spec):
        skeleton = adapter_skeleton(folder, source)
        base_dtype = saved_export.get("base_weights_dtype")
        cast = getattr(torch, base_dtype) if isinstance(base_dtype, str) else None
        logits = export_logits(folder, batch, skeleton, model_folder(source), cast=cast)
        out["how"] += ("; LoRA: peft's own readers of the adapter folder (PeftConfig.from_pretrained, "
                       f"load_peft_weights), base weights from {source}"
                       + (f" held as {base_dtype} as in training" if cast else ""))
        if (folder / MERGED).is_dir():
            merged = export_logits(folder / MERGED, batch)
            out.update(merged_max_abs_logit_diff=(merged - saved).abs().max().item(),
                       merged_tolerance=MERGE_TOLERANCE, merged_layout=export_layout(folder / MERGED))
    else:
        logits = export_logits(folder, batch)
        out["layout"] = export_layout(folder)
    out["max_abs_logit_diff"] = (logits - saved).abs().max().item()
    ok = out["max_abs_logit_diff"] <= RELOAD_TOLERANCE and out.get("layout", {}).get("files_as_save_pretrained", True)
    if "merged_max_abs_logit_diff" in out:
        ok = ok and out["merged_max_abs_logit_diff"] <= MERGE_TOLERANCE \
            and out["merged_layout"]["files_as_save_pretrained"]
    training = saved_export.get("training_vs_streamed_max_abs_logit_diff")
    if training is not None:
        # The gathered weights are the model that trained: its own forward (sharded, on its
        # device, training precision) against the streamed one. Checked where both are CPU fp32.
        out["training_model_max_abs_logit_diff"] = training
        if spec.method == "qlora":
            out["training_model_note"] = ("recorded, not checked: the training model's base is 4-bit NF4; the "
                                          "streamed forward runs the full-precision base the export is loaded on")
        elif spec.device == "cpu" and spec.precision == "fp32":
            out["training_model_tolerance"] = RELOAD_TOLERANCE
            ok = ok and training <= RELOAD_TOLERANCE
        else:
            out["training_model_note"] = (f"recorded, not checked: the training model ran on {spec.device} in "
                                          f"{spec.precision}, the streamed forward on the CPU in fp32")
    return {"status": PASSED if ok else FAILED, **out}


def streamed_outputs(validator, strategy):
    """Collective: the strategy's state gathered one layer at a time (Strategy.state_groups),
    run on rank 0's CPU in fp32: (None, logits of the fixed eval batch) on rank 0, (None, None)
    elsewhere (no process holds the whole model)."""
    from distlab.checkpoints.export import eval_batch
    from distlab.runtime.qlora import trained_groups
    from distlab.runtime.streamed import Skeleton, streamed_logits

    groups = trained_groups(strategy, validator.spec, validator.job.model_source)
    if validator.rank != 0:
        for _ in groups:
            pass
        return None, None
    return None, streamed_logits(Skeleton.for_run(validator.job.model_source, validator.spec), groups,
                                 eval_batch(validator.job.data_dir))


def lora_base_frozen(model, source: str, meta: dict, now: dict, reload_diff: float) -> dict:
    """A LoRA checkpoint holds no base weight: the base it names (sha256 of its files) must be
    the folder's (`now`, checkpoint.base_identity), and base + reloaded adapters must give the
    logits of the trained state."""
    saved = meta.get("base_model") or {}
    source = now["source"]
    same = bool(saved) and saved.get("weights_sha256") == now["weights_sha256"]
    ok = same and reload_diff <= RELOAD_TOLERANCE
    return {"status": PASSED if ok else FAILED, "base_identity_matches": same,
            "base_files": sorted(now["weights_sha256"]),
            "reload_max_abs_logit_diff": reload_diff, "tolerance": RELOAD_TOLERANCE,
            "how": "the checkpoint holds adapters only; the base it names by the sha256 of its weight files equals "
                   f"{source}'s, and that base + the reloaded adapters reproduce the trained model's logits "
                   "(the reload check): the base stayed frozen"}

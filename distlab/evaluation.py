"""Held-out evaluation: did fine-tuning help? The base model once (rule evaluate_base_model)
and every trained run (in the worker, after its last step) on the same tokens: the eval
split's first data.eval_blocks blocks.

loss = cross-entropy summed over every label position after the causal shift (labels -100,
the masked prompt tokens of chat/instruction data, left out) / the number of those
positions; perplexity = exp(loss). The run's model is evaluated whole, on rank 0: the
strategy's full_state_dict() (a collective every strategy implements for its export) loaded
into a plain Hugging Face model, so sharded, pipelined and tensor-parallel runs are measured
exactly like DDP.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

EVAL_BATCH = 8
HOW = ("mean cross-entropy over the label positions (after the causal shift, -100 excluded) of the eval "
       "split's first {n} blocks; perplexity = exp(loss); fp32, model.eval(), no grad")


def eval_tokens(data_dir, n_blocks: int | None = None):
    """(input_ids, labels) of the eval split's first n blocks (n from the data folder's
    distlab_data.json, i.e. data.eval_blocks, when not given)."""
    from distlab.data import load_blocks, load_labels, read_data_info

    n = n_blocks or read_data_info(data_dir).get("eval_blocks", 16)
    ids = load_blocks(data_dir, "eval")[:n]
    labels = load_labels(data_dir, "eval")
    return ids, (ids if labels is None else labels[:n])


def evaluate_model(model, ids, labels, device=None) -> dict:
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), EVAL_BATCH):
            batch = ids[start:start + EVAL_BATCH].to(device or "cpu")
            target = labels[start:start + EVAL_BATCH].to(batch.device)[:, 1:]
            logits = model(input_ids=batch).logits[:, :-1].float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                                     reduction="sum").item()
            count += int((target != -100).sum())
    loss = total / count if count else math.nan
    return {"loss": loss, "perplexity": math.exp(loss) if count else math.nan, "tokens": count,
            "blocks": len(ids), "how": HOW.format(n=len(ids))}


IN_PLACE_HOW = ("the wrapped model in place on every rank (no grad, eval mode, the run's precision), the "
                "eval split's first {n} blocks; loss and perplexity as in the final eval")


def evaluate_in_place(strategy, ids, labels) -> dict:
    """Collective: the model as the strategy holds it (sharded, split or whole), every rank
    running every eval block, so each rank's collectives (all-gathers, TP all-reduces) match;
    eval_every's points during training (distlab.monitor). Mode restored afterwards."""
    import torch
    import torch.nn.functional as F

    from distlab.strategies.base import autocast

    model, device = strategy.model, strategy.ctx.device
    training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad(), autocast(strategy.spec, device):
            for start in range(0, len(ids), EVAL_BATCH):
                batch = ids[start:start + EVAL_BATCH].to(device)
                target = labels[start:start + EVAL_BATCH].to(device)[:, 1:]
                logits = model(input_ids=batch).logits[:, :-1].float()
                total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                         ignore_index=-100, reduction="sum").item()
                count += int((target != -100).sum())
    finally:
        model.train(training)
    loss = total / count if count else math.nan
    return {"loss": loss, "perplexity": math.exp(loss) if count else math.nan, "tokens": count,
            "how": IN_PLACE_HOW.format(n=len(ids))}


def evaluate_consolidated(strategy, job: dict, ids, labels) -> dict | None:
    """Collective: the strategy's full_state_dict() in a plain model on rank 0 (None elsewhere),
    for strategies whose ranks cannot each run the whole forward (pipeline stages)."""
    import torch.distributed as dist

    from distlab.checkpoint import consolidated_model

    full = strategy.full_state_dict()
    if dist.get_rank() != 0:
        return None
    out = evaluate_model(consolidated_model(full, job["model_source"], job["spec"]), ids, labels)
    out["how"] = "the strategy's full_state_dict() in a plain model on rank 0 (fp32): " + out["how"]
    return out


def evaluate_base(model_source: str, data_dir, out_path) -> dict:
    """Rule evaluate_base_model: the untouched base model on the eval tokens."""
    from distlab.model import load_model

    ids, labels = eval_tokens(data_dir)
    result = {"model": str(model_source), "data_dir": str(data_dir),
              **evaluate_model(load_model(model_source), ids, labels)}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return result


def evaluate_run(strategy, job: dict) -> dict | None:
    """Collective (every rank calls it): the trained model on the eval tokens, on rank 0.
    Returns {"trained", "base"} on rank 0 (base from the base-model rule's file, when the job
    names one), None on the other ranks."""
    import torch.distributed as dist

    from distlab.checkpoint import consolidated_model

    if job["spec"].get("memory_budget_gib") is not None:
        # Rank 0 rebuilds the whole model to evaluate it: under a per-rank budget that copy
        # alone would end a sharded run as oom. Recorded as not evaluated, with the reason.
        if dist.get_rank() != 0:
            return None
        out = {"trained": {"status": "not evaluated",
                           "reason": "memory_budget_gib is set: the whole-model evaluation on rank 0 would count "
                                     "against the per-rank budget this run measures"}}
    else:
        try:
            full = strategy.full_state_dict()
        except NotImplementedError as exc:  # every rank raises alike
            return {"trained": {"status": "not evaluated", "reason": str(exc)}} if dist.get_rank() == 0 else None
        if dist.get_rank() != 0:
            return None
        try:
            model = consolidated_model(full, job["model_source"], job["spec"])
            del full
            ids, labels = eval_tokens(job["data_dir"])
            out = {"trained": evaluate_model(model, ids, labels)}
        except Exception as exc:  # rank 0 only, after the collective: recorded, the run's training stands
            out = {"trained": {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:500]}}
    base = job.get("base_eval_json")
    if base:
        out["base"] = json.loads(Path(base).read_text())
    else:
        out["base"] = {"status": "not given", "reason": "the job names no base-model eval (rule evaluate_base_model)"}
    return out


def eval_sentence(runs: list[dict]) -> str:
    """One line for a stage card: base -> trained eval loss of the stage's runs."""
    moved = []
    for run in runs:
        ev = run.get("eval") or {}
        trained, base = ev.get("trained") or {}, ev.get("base") or {}
        if trained.get("loss") is not None and base.get("loss") is not None:
            moved.append(f"{run['experiment']} {base['loss']:.3f} -> {trained['loss']:.3f} "
                         f"({trained['tokens']} tokens)")
    masked = []
    for run in runs:
        tokens = ((run.get("data_prep") or {}).get("run_tokens")) or {}
        if tokens.get("masked"):
            masked.append(f"{run['experiment']} trained on {tokens['trained']:,} response tokens, "
                          f"{tokens['masked']:,} prompt tokens masked")
    text = ("Fine-tuning moved held-out eval loss (base model -> trained, same tokens): " + "; ".join(moved) + "."
            if moved else "Held-out evaluation: no run of this stage recorded both a base and a trained eval loss.")
    return text + (" " + "; ".join(masked) + "." if masked else "")


def eval_columns(frame, runs: list[dict]):
    """summary.csv's eval columns, matched to rows by machine and experiment."""
    by_key = {(r["machine"], r["experiment"]): r.get("eval") or {} for r in runs}

    def pick(row, part, key):
        value = (by_key.get((row["machine"], row["experiment"]), {}).get(part) or {}).get(key)
        return value if isinstance(value, (int, float)) else None

    if frame.empty:
        return frame
    frame["eval_loss_base"] = frame.apply(lambda row: pick(row, "base", "loss"), axis=1)
    frame["eval_loss"] = frame.apply(lambda row: pick(row, "trained", "loss"), axis=1)
    frame["eval_perplexity"] = frame.apply(lambda row: pick(row, "trained", "perplexity"), axis=1)
    return frame

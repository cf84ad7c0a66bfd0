"""Held-out evaluation: did fine-tuning help? The base model once (rule evaluate_base_model)
and every trained run (in the worker, after its last step) on the same tokens: the eval
split's first data.eval_blocks blocks.

loss = cross-entropy summed over every label position after the causal shift (labels -100,
the masked prompt tokens of chat/instruction data, left out) / the number of those
positions; perplexity = exp(loss). The run's model is evaluated as it trains: still
sharded or split, on its own devices, through the strategy's collective forward
(Strategy.forward_logits: FSDP and ZeRO-3 gather a layer at a time, tensor-parallel ranks
compute their slices, pipeline stages pass activations on), so no rank ever holds the whole
model to evaluate it and a run under a memory budget is evaluated too.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from distlab.records.spec import Spec
from distlab.records.job import Job

EVAL_BATCH = 8
HOW = ("mean cross-entropy over the label positions (after the causal shift, -100 excluded) of the eval "
       "split's first {n} blocks; perplexity = exp(loss); model.eval(), no grad, {where}")


def eval_tokens(data_dir, n_blocks: int | None = None):
    """(input_ids, labels) of the eval split's first n blocks (n from the data folder's
    distlab_data.json, i.e. data.eval_blocks, when not given)."""
    from distlab.data_prep.data import load_blocks, load_labels, read_data_info

    n = n_blocks or read_data_info(data_dir).get("eval_blocks", 16)
    ids = load_blocks(data_dir, "eval")[:n]
    labels = load_labels(data_dir, "eval")
    return ids, (ids if labels is None else labels[:n])


def eval_positions(data_dir, n_blocks: int | None = None):
    """The position ids of eval_tokens' blocks where rows are packed as documents (None otherwise)."""
    from distlab.data_prep.data import load_positions, read_data_info

    positions = load_positions(data_dir, "eval")
    return None if positions is None else positions[:n_blocks or read_data_info(data_dir).get("eval_blocks", 16)]


def forward_inputs(positions, start: int, stop: int, device) -> dict:
    """The forward's arguments besides the tokens: packed rows' position ids (no cache), or none."""
    from distlab.data_prep.packing import packed_inputs

    return {} if positions is None else packed_inputs(positions[start:stop].to(device))


def loss_terms(logits, labels):
    """(summed cross-entropy, label positions) of one batch's logits, as tensors on the logits'
    device (the CPU labels moved there)."""
    import torch.nn.functional as F

    length = logits.shape[1] - 1  # narrow, not [:, 1:]: plain ATen ops (tests/test_cuda_contracts.py)
    target = labels.narrow(1, 1, length).to(logits.device)
    shifted = logits.narrow(1, 0, length).float()
    total = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), target.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (target != -100).sum()


def loss_sum(logits, labels) -> tuple[float, int]:
    total, count = loss_terms(logits, labels)
    return total.item(), int(count)


def summarize_loss(total: float, count: int, blocks: int, where: str) -> dict:
    loss = total / count if count else math.nan
    return {"loss": loss, "perplexity": math.exp(loss) if count else math.nan, "tokens": count, "blocks": blocks,
            "how": HOW.format(n=blocks, where=where)}


def evaluate_model(model, ids, labels, device=None, positions=None) -> dict:
    """A plain model (one process holds it) on the eval tokens (positions: packed rows' position
    ids), fp32."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), EVAL_BATCH):
            batch = ids[start:start + EVAL_BATCH].to(device or "cpu")
            extra = forward_inputs(positions, start, start + EVAL_BATCH, device or "cpu")
            part = loss_sum(model(input_ids=batch, **extra).logits, labels[start:start + EVAL_BATCH])
            total, count = total + part[0], count + part[1]
    return summarize_loss(total, count, len(ids), "fp32, the whole model in one process")


def evaluate_base(model_source: str, data_dir, out_path, threads: int | None = None) -> dict:
    """Rule evaluate_base_model: the untouched base model on the eval tokens, on `threads` host
    cores (the job's; None: torch's own default)."""
    import torch

    from distlab.runtime.model import load_model

    if threads is not None:
        torch.set_num_threads(threads)
    ids, labels = eval_tokens(data_dir)
    result = {"model": str(model_source), "data_dir": str(data_dir),
              **evaluate_model(load_model(model_source), ids, labels, positions=eval_positions(data_dir)),
              "threads": torch.get_num_threads()}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return result


def evaluate_forward(strategy, ids, labels, positions=None) -> dict | None:
    """Collective: held-out loss of the model as the strategy holds it (Strategy.forward_logits:
    still sharded or split, on its device, training precision), eval_batch_size sequences at a
    time (the micro-batch, or more where their no-grad forward holds less than training keeps for
    one micro-batch, so the evaluation fits wherever training fits). The
    record on rank 0, None elsewhere. The final eval and eval_every's points (distlab.rank.monitor).

    Data-parallel ranks split the batches (batch i goes to data-parallel rank i mod size) and
    sum their parts, as they split training batches: the same batches give the same logits
    wherever they run, so the loss is the one a single rank would find, for 1/size of the work
    per rank. Where a forward is collective (FSDP, ZeRO: every rank joins each layer's gather),
    a rank whose batches ran out joins the remaining forwards on a batch it does not count."""
    import torch.distributed as dist

    spec = strategy.spec
    size, rank = strategy.data_parallel_size, strategy.data_parallel_rank
    batch = eval_batch_size(spec, getattr(strategy.unwrapped(), "config", None), ids.shape,
                            size == dist.get_world_size())
    starts = list(range(0, len(ids), batch))
    mine = starts[rank::size]
    rounds = -(-len(starts) // size) if strategy.collective_forward else len(mine)
    total, count, error = 0.0, 0, None
    for i in range(rounds):
        counted = i < len(mine)
        start = mine[i] if counted else 0
        logits = strategy.forward_logits(ids[start:start + batch], every_rank=size > 1,
                                         extra=forward_inputs(positions, start, start + batch, strategy.ctx.device))
        if logits is not None and counted and error is None:
            try:
                part = loss_sum(logits, labels[start:start + batch])
                total, count = total + part[0], count + part[1]
            except Exception as exc:  # recorded on rank 0, the run's training stands
                error = f"{type(exc).__name__}: {exc}"[:500]
        del logits
    if size > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (total, count, error))
        total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
        error = next((p[2] for p in parts if p[2]), None)
    if dist.get_rank() != 0:
        return None
    where = (f"the training model itself ({spec.strategy}, on {strategy.ctx.device.type}, "
             f"{spec.precision}; Strategy.forward_logits, {batch} sequences a forward"
             + (f", batches split over {size} data-parallel ranks)" if size > 1 else ")"))
    return {"status": "failed", "reason": error} if error else summarize_loss(total, count, len(ids), where)


def eval_batch_size(spec: Spec, config, shape, data_parallel: bool) -> int:
    """Sequences per eval forward: the micro-batch, times how many sequences' no-grad forward
    holds no more than autograd keeps for one sequence in training (fp32 bytes per sequence,
    from the model's config):
      no grad:  S*(3V + 3I + A*S)     logits, their fp32 copy and log-softmax; one layer's MLP
                                      (gate, up, product) and attention scores at a time
      training: S*(2V + L*(4H + 3I))  a lower bound of what backward needs: logits and their
                                      log-softmax; per layer norm outputs, attention output,
                                      residual, MLP gate, up and product
    S tokens, V vocabulary, H hidden, I MLP width, A heads, L layers. A forward of ZeRO-3 or
    FSDP gathers its parameters whatever the batch, so fewer forwards cost fewer gathers (the
    stage-3 budget run: 8 forwards a rank at micro-batch 1 -> 2). Kept at the micro-batch with
    activation checkpointing (training keeps far less) and where ranks split the model (TP, PP)."""
    micro = spec.micro_batch
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
    if not data_parallel or spec.activation_checkpointing != "none" or \
            not all(isinstance(getattr(config, f, None), int) for f in fields):
        return micro
    blocks, seq = shape[0], shape[1]
    v, h, i, a, layers = (getattr(config, f) for f in fields)
    no_grad, training = seq * (3 * v + 3 * i + a * seq), seq * (2 * v + layers * (4 * h + 3 * i))
    per_rank = -(-blocks // max(1, spec.world_size))
    return max(micro, min(micro * (training // no_grad), per_rank))


def evaluate_sharded(strategy, job: Job) -> dict | None:
    """Collective: the causal LM's trained model on the eval tokens (evaluate_forward)."""
    return evaluate_forward(strategy, *eval_tokens(job.data_dir), eval_positions(job.data_dir))


def evaluate_run(strategy, job: Job, last_point: dict | None = None) -> dict | None:
    """Collective (every rank calls it): the trained model on the task's held-out data
    (Task.evaluate_trained; causal LM: evaluate_sharded). Returns {"trained", "base"} on rank 0
    (base from the base-model rule's file, when the job names one), None on the other ranks.

    last_point: the eval point distlab.rank.monitor took after the last step (every rank holds it).
    It is that same computation (evaluate_forward on the eval split's tokens, the model as it
    ended), so it is the trained figure rather than a second pass over the same tokens."""
    import torch.distributed as dist

    if last_point is not None and "loss" in last_point:
        trained = {k: v for k, v in last_point.items() if k not in ("step", "steps_done")}
        trained["how"] += f" (the eval point after step {last_point['steps_done']}, the last)"
    else:
        trained = strategy.task.evaluate_trained(strategy, job)
    if dist.get_rank() != 0:
        return None
    out = {"trained": trained}
    base = job.base_eval_json
    if base:
        out["base"] = json.loads(Path(base).read_text())
    else:
        out["base"] = {"status": "not given", "reason": "the job names no base-model eval (rule evaluate_base_model)"}
    return out


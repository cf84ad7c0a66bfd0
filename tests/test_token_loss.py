"""A step optimises the mean over its label tokens, however its global batch is cut into
micro-batches and ranks (distlab/runtime/accumulation.py): on instruction data, where every
micro-batch holds a different number of label tokens, the three splits of one global batch of 8
give the same step-0 loss and pre-clip gradient norm. (DeepSpeed, Accelerate, FSDP and TP/PP
divide by their own counts: their parity tests hold their norms and losses to DDP's.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import resolve, run_experiment
from distlab.testing import build_instruction_data

# (strategy, world size, micro-batch, accumulation): the same 8 samples in step 0.
SPLITS = [("ddp", 1, 8, 1), ("ddp", 1, 2, 4), ("ddp", 2, 2, 2)]


def first_step(run_dir: Path) -> dict:
    return json.loads((run_dir / "steps.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
def test_one_global_batch_gives_the_same_step_loss_and_gradient_however_it_is_split(prepared, tmp_path):
    from distlab.data_prep.data import load_labels

    data_dir = build_instruction_data(prepared, tmp_path / "data32")  # packing documents: position ids reach the model
    seen = {}
    for strategy, world, micro, accum in SPLITS:
        name = f"{strategy}.w{world}.mb{micro}.ga{accum}"
        spec = resolve({"strategy": strategy, "world_size": world, "micro_batch": micro, "grad_accum": accum,
                        "tag": name}, steps=2, untimed_steps=1)
        metrics = run_experiment(prepared, tmp_path / name, spec, checkpoint=False, data_dir=data_dir)
        step = first_step(tmp_path / name)
        seen[name] = (metrics["loss"]["first"], step["grad_norm"], sorted(sum(step["samples_by_rank"], [])))
    (loss, norm, samples), *others = seen.values()
    labels = load_labels(data_dir, "train")[samples]
    per_sample = (labels[:, 1:] != -100).sum(dim=1)
    assert len(set(per_sample.tolist())) > 1  # unequal label counts: a mean of micro-batch means would differ
    for name, (other_loss, other_norm, other_samples) in zip(list(seen)[1:], others):
        assert other_samples == samples, name
        assert abs(other_loss - loss) < 1e-5, (name, other_loss, loss)
        assert abs(other_norm - norm) < 1e-5, (name, other_norm, norm)

"""The advisor: roadmap rules from hardware and a config.json alone, memory estimates that
match what models and runs really hold, and GPU presets that validate and advise as documented."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from distlab.records.spec import Spec
import yaml

from distlab.tools import advisor, advisor_check
from distlab.configuration.config import load

REPO = Path(__file__).resolve().parent.parent
PRESETS = REPO / "config" / "presets"
GIB = 2**30
LLAMA7B = json.loads((PRESETS / "models" / "llama-2-7b" / "config.json").read_text())
NO_GPU = {"machine": "box", "gpus": []}


def plan(gpus, nvlink=False, nodes=1, **defaults):
    cfg = {"advisor": {"gpu_memory_gib": gpus, "nvlink": nvlink, "nodes": nodes, "headroom": 0.1},
           "defaults": {"precision": "bf16", **defaults}}
    return advisor.advise(LLAMA7B, NO_GPU, cfg)


def test_parameter_count_matches_the_published_llama_sizes():
    assert advisor.parameter_counts(advisor.model_shape(LLAMA7B))["total"] == 6_738_415_616
    big = json.loads((PRESETS / "models" / "llama-2-70b" / "config.json").read_text())
    assert advisor.parameter_counts(advisor.model_shape(big))["total"] == 68_976_648_192


def test_parameter_counts_match_the_real_model_with_and_without_lora(prepared):
    from distlab.runtime.lora import apply_lora
    from distlab.runtime.model import load_model

    model = load_model(str(prepared / "model"))
    shape = advisor.model_shape(model.config.to_dict())
    assert advisor.parameter_counts(shape)["total"] == sum(p.numel() for p in model.parameters())
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}
    model, _ = apply_lora(model, lora, seed=0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert advisor.parameter_counts(shape, lora)["trainable"] == trainable


def test_state_formulas_are_what_distlab_allocates():
    counts = {"total": 1000, "trainable": 1000, "largest_unit": 0}
    n = 4
    state = {k: advisor.model_state(k, counts, n, "bf16", lora=False, grad_accum=2) for k in advisor.ROW_ORDER}
    held = {k: v["params"] + v["grads"] + v["optimizer"] for k, v in state.items()}
    # ZeRO-1 without accumulation: gradients reduce-scattered right after backward.
    assert advisor.model_state("zero1", counts, n, "bf16", lora=False)["grads"] == 2 * 1000 / n
    # DDP under bf16 autocast: fp32 weights and grads, DDP's gradient buckets, AdamW.
    assert held["ddp"] == (4 + 4 + 4 + 8) * 1000
    # DeepSpeed bf16: 2-byte module and grads, fp32 master + Adam (12) sharded from ZeRO-1.
    assert held["zero1"] == 4 * 1000 + 12 * 1000 / n
    assert held["zero2"] == 2 * 1000 + 14 * 1000 / n
    assert held["zero3"] == 16 * 1000 / n
    # Optimizer offload: Adam + masters and an fp32 gradient partition in CPU RAM.
    assert state["zero3-offopt"]["cpu_offloaded"] == 16 * 1000 / n
    fp32 = {k: advisor.model_state(k, counts, n, "fp32", lora=False) for k in advisor.ROW_ORDER}
    # DeepSpeed keeps an fp32 master partition in fp32 runs too (measured: 12 bytes/param of optimizer).
    assert fp32["zero1"]["optimizer"] == 12 * 1000 / n and fp32["zero3"]["params"] == 4 * 1000 / n
    lora = {"total": 1000, "trainable": 10, "largest_unit": 0}
    ddp_lora = advisor.strategy_state("ddp", lora, 1, "bf16", lora=True)
    assert ddp_lora["params"] == 2 * 990 + 4 * 10 and ddp_lora["grads"] == 8 * 10 and ddp_lora["optimizer"] == 8 * 10
    ds_lora = advisor.strategy_state("deepspeed", lora, 2, "bf16", lora=True, settings={"zero_stage": 3})
    assert ds_lora["params"] == 2 * 1000 / 2 and ds_lora["optimizer"] == 12 * 10 / 2


def test_sharded_state_counts_padding():
    # Two parameters of 3 and 5 elements over 2 ranks: ZeRO-3 pads each to a multiple of 2.
    counts = {"total": 8, "trainable": 8, "largest_unit": 5, "_shapes": [((3,), True), ((5,), True)]}
    lean = {"zero_stage": 3, "zero3_profile": "lean"}  # nothing persistent: every parameter partitioned
    z3 = advisor.strategy_state("deepspeed", counts, 2, "fp32", lora=False, settings=lean)
    assert z3["params"] == 4 * (2 + 3)
    # The auto profile keeps parameters up to 10 x hidden size whole on every rank, beside their partition.
    auto = advisor.strategy_state("deepspeed", {**counts, "hidden_size": 0.4}, 2, "fp32", lora=False,
                                  settings={"zero_stage": 3})
    assert auto["params"] == 4 * (2 + 3 + 3)
    fsdp = advisor.strategy_state("fsdp", {**counts, "_shapes": [((3, 4), True)], "total": 12, "trainable": 12},
                                  2, "fp32", lora=False)
    assert fsdp["params"] == 4 * 2 * 4  # dim 0 of 3 padded to 4, split over 2


def test_tensor_parallel_rank_holds_its_split_of_the_plans_linears_and_the_rest_whole(prepared):
    """The TP formula reads the model's own tp plan: on the tests' Llama every q/k/v/o and
    gate/up/down weight is split over the ranks, the embeddings, head and norms are not."""
    import torch

    from distlab.runtime.model import decoder_layers, load_model

    model = load_model(str(prepared / "model"))
    counts = advisor.parameter_counts(advisor.model_shape(model.config.to_dict()))
    linears = sum(m.weight.numel() for layer in decoder_layers(model) for m in layer.modules()
                  if isinstance(m, torch.nn.Linear))
    tp = advisor.strategy_state("tp", counts, 2, "fp32", lora=False)
    assert tp["params"] == 4 * (counts["total"] - linears / 2)
    assert tp["grads"] == tp["params"] and tp["optimizer"] == 2 * tp["params"]
    gpt2 = advisor.parameter_counts(advisor.model_shape({"model_type": "gpt2", "n_embd": 32, "n_layer": 2,
                                                         "n_head": 2, "vocab_size": 100}))
    assert advisor.strategy_state("tp", gpt2, 2, "fp32", lora=False) is None  # no tp plan: refused, no formula


def test_fits_one_gpu_means_ddp():
    advice = plan([80, 80], method="lora", micro_batch=1, seq_len=512)
    assert advice["recommendation"] == "ddp"


def test_too_big_for_one_gpu_but_not_for_all_means_zero3_or_fsdp():
    advice = plan([80, 80], nvlink=True, method="full", micro_batch=1, seq_len=1024)
    assert advice["recommendation"] == "zero3" and "ZeRO-3 or FSDP" in advice["reasons"][0]


def test_still_too_big_means_offload():
    advice = plan([24, 24], method="full", micro_batch=1, seq_len=512)
    assert advice["recommendation"].startswith("zero3-offopt")


def test_different_gpu_sizes_are_limited_by_the_smallest():
    advice = plan([80, 24], method="lora", micro_batch=1, seq_len=512)
    assert advice["devices"]["smallest_bytes"] == 24 * GIB
    assert any("limited by the smallest (24 GiB)" in r for r in advice["reasons"])


def test_no_nvlink_avoids_tensor_and_pipeline_parallel_and_several_machines_suggest_ray():
    advice = plan([24, 24], nvlink=False, nodes=2, method="lora", micro_batch=1, seq_len=512)
    assert any("avoid tensor and pipeline parallel" in r for r in advice["reasons"])
    assert any("Ray Train" in r for r in advice["reasons"])
    assert advice["devices"]["devices"] == 4


def test_estimate_check_says_where_it_was_wrong():
    advice = plan([24], method="full", micro_batch=1, seq_len=128, precision="fp32")
    shape = advice["model"]["shape"]
    psi = advisor.parameter_counts(shape)["total"]
    spec = {"strategy": "ddp", "world_size": 1, "method": "full", "micro_batch": 1, "seq_len": 128,
            "precision": "fp32", "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}}
    held = {"params": 4 * psi, "grads": 4 * psi, "grad_buckets": 4 * psi, "optimizer": 8 * psi}
    run = {"machine": "m", "experiment": "e", "status": "ok", "spec": spec,
           "memory": {"model_state_bytes_per_rank": [held], "per_rank": [{}]}}
    assert advisor_check.check_against_runs(advice, [run])[0]["verdict"] == "right"
    held["optimizer"] = 16 * psi  # e.g. an optimizer keeping an extra fp32 copy the formula forgot
    (row,) = advisor_check.check_against_runs(advice, [run])
    assert row["verdict"] == "WRONG" and row["where"].startswith("optimizer: estimated")
    # A total within the tolerance does not hide a part that is far off (here params 1.5x,
    # grads 0.5x: the total still matches).
    held.update(optimizer=8 * psi, params=6 * psi, grads=2 * psi)
    (row,) = advisor_check.check_against_runs(advice, [run])
    assert row["measured/estimated"] == 1 and row["verdict"] == "WRONG" and row["where"].startswith("params:")


def test_the_report_holds_each_run_to_the_estimate_it_recorded_and_checks_none_without_one():
    from distlab.records.memory_check import check_memory_estimates

    advice = plan([24], method="full", micro_batch=1, seq_len=128, precision="fp32")
    psi = advisor.parameter_counts(advice["model"]["shape"])["total"]
    spec = Spec({"strategy": "ddp", "world_size": 1, "method": "full", "micro_batch": 1, "seq_len": 128,
                 "precision": "fp32", "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}})
    recorded = advisor_check.estimate_record(advice["model"]["shape"], spec)  # what rank 0 writes
    assert recorded["row"] == "ddp" and recorded["params"] == 4 * psi and recorded["held_activation_bytes"] > 0
    held = {"params": 4 * psi, "grads": 4 * psi, "grad_buckets": 4 * psi, "optimizer": 8 * psi}
    run = {"machine": "m", "experiment": "e", "status": "ok", "spec": spec, "memory_estimate": recorded,
           "memory": {"model_state_bytes_per_rank": [held], "per_rank": [{"activations": {"bytes": 1}}]}}
    (row,) = check_memory_estimates([run])
    assert row["verdict"] == "right" and row["estimate"] == "ddp" and row["measured_activations_MiB"] is not None
    # Recomputed for the same spec (the tests' path) or recorded (the report's): the same rows.
    assert advisor_check.check_against_runs(advice, [run]) == [row]
    assert check_memory_estimates([{**run, "memory_estimate": None}]) == []  # nothing recorded: not checked


# preset -> (recommendation, devices, estimated GiB per device of the recommended row). The
# activations are distlab.runtime.activations' estimate (fitted to saved-tensor measurements).
EXPECTED = {
    # DDP LoRA bf16: frozen base in bf16, adapters fp32 with grads, DDP buckets and AdamW (meta-device count).
    "llama7b-lora-2x24gb": ("ddp", 2, 17.20),
    "llama70b-lora-zero3-offload-1x24gb": ("zero3-offopt-offparam", 1, 10.77),
    "llama7b-full-fsdp-2x80gb": ("zero3", 2, 57.22),
    # Named boxes (advisor.devices + a named interconnect): the advice also ranks by predicted time.
    "box-2x3090-nvlink-llama7b-lora": ("ddp", 2, 17.20),
    # QLoRA: the decoder's linear weights at 0.5 byte: 7B fits the 12 GiB RTX 3060 under DDP.
    "box-4090-3060-pcie-llama7b-qlora": ("ddp", 2, 8.64),
    "box-8xh100-llama3-8b-full": ("zero3", 8, 29.92),
    "box-home-cloud-1gbe-llama7b-lora": ("ddp", 2, 17.20),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gpu_preset_is_schema_valid_and_advised_as_documented(name, monkeypatch):
    monkeypatch.chdir(REPO)  # presets name their model folders relative to the repository
    # The presets ship config-only folders (no weights, no tokenizer): the workflow refuses to
    # train on them until model.path names the user's download, whose tokenizer is checked then
    # (tests/test_data_tokenizer.py); the advisor needs only config.json.
    import distlab.configuration.tokenizer_checks

    monkeypatch.setattr(distlab.configuration.tokenizer_checks, "check_tokenizer", lambda config: None)
    raw = yaml.safe_load((PRESETS / f"{name}.yaml").read_text())
    config, specs = load(raw, gpu_count=max(2, len((raw.get("advisor") or {}).get("devices") or [])))
    assert specs and all(s["device"] == "cuda" for s in specs.values())
    model_config = json.loads((Path(config["model"]["path"]) / "config.json").read_text())
    advice = advisor.advise(model_config, NO_GPU, config)
    pick, devices, gib = EXPECTED[name]
    assert advice["recommendation"] == pick and advice["devices"]["devices"] == devices
    row = next(r for r in advice["estimates"] if r["key"] == pick)
    assert row["total_bytes"] / GIB == pytest.approx(gib, abs=0.01)
    assert row["total_bytes"] <= advice["usable_bytes_per_device"]


def test_every_preset_is_covered_by_a_test():
    assert {p.stem for p in PRESETS.glob("*.yaml")} == set(EXPECTED)

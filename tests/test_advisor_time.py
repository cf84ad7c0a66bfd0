"""The time ranking of a named box (distlab/tools/advisor_time.py): each term against a hand
computation, rankings whose order follows by reasoning, cited inputs and references, and the
advice's markdown."""
import json
from pathlib import Path

import pytest
import yaml

from distlab.tools import advisor_time as at
from distlab.configuration.hardware import gpu_peak

REPO = Path(__file__).resolve().parent.parent

# A hand-made tiny model: 2 layers of 4 linears 64x64, embedding 1000x64 untied, 1 head of 64.
SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 1, "head_dim": 64, "hidden_size": 64,
         "tie_word_embeddings": False}
LINEARS = [("q", 64, 64, None), ("k", 64, 64, None), ("v", 64, 64, None), ("o", 64, 64, None),
           ("lm_head", 64, 1000, None)]
COUNTS = {"total": 2 * 4 * 64 * 64 + 2 * 64 * 1000, "embedding": 64 * 1000,
          "trainable": 2 * 4 * 64 * 64 + 2 * 64 * 1000,
          "layers": 2, "_linears": LINEARS, "quantized": 0, "per_layer": 4 * 64 * 64, "hidden_size": 64,
          "_shapes": [((64, 64), True)] * 8 + [((1000, 64), True)] * 2}
WORKLOAD = {"method": "full", "micro_batch": 2, "seq_len": 16, "grad_accum": 1, "precision": "bf16"}
RTX3090 = {"name": "NVIDIA GeForce RTX 3090", "memory_gib": 24}


def test_each_term_matches_a_hand_computation():
    link = at.INTERCONNECTS["pcie4"]
    row = at.predict_row("ddp", SHAPE, COUNTS, WORKLOAD, [RTX3090, RTX3090], link, "none")
    tokens = 2 * 16
    per_token = 6 * (COUNTS["total"] - COUNTS["embedding"]) + 12 * 2 * 1 * 64 * 16
    peak = 71e12
    assert row["terms"]["compute"]["seconds"] == pytest.approx(tokens * per_token / (peak * 0.33))
    # One DDP bucket (the gradients are under 1 MiB): the last bucket is exposed whole.
    grads = 4 * COUNTS["trainable"]
    pcie4_busbw = 16e9 * 16 / 8 * 128 / 130 * 370 / 450  # x16 lanes at 16 GT/s, 128b/130b, NCCL's effective share
    one_call = 42.14e-6 + grads * 2 * (2 - 1) / 2 / pcie4_busbw
    assert row["terms"]["communication"]["seconds"] == pytest.approx(one_call)
    assert row["terms"]["optimizer"]["seconds"] == pytest.approx(28 * COUNTS["trainable"] / 936e9)
    assert row["terms"]["bubble"]["seconds"] == 0
    assert row["step_time_s"] == pytest.approx(sum(t["seconds"] for t in row["terms"].values()))
    assert row["tokens_per_s_per_device"] == pytest.approx(tokens / row["step_time_s"])


def test_offload_terms_and_the_slowest_device_setting_the_step():
    link = at.INTERCONNECTS["pcie4"]
    slow = {"name": "RTX 3060", "memory_gib": 12}
    row = at.predict_row("zero3-offopt-offparam", SHAPE, COUNTS, WORKLOAD, [RTX3090, slow], link, "none")
    flops = at.compute_flops(SHAPE, COUNTS, WORKLOAD, "none")["flops"]
    peak = gpu_peak("NVIDIA GeForce RTX 3060", "bf16")[0]
    assert row["terms"]["compute"]["seconds"] == pytest.approx(flops / (peak * 0.33))
    parts = row["terms"]["optimizer"]["parts"]
    shard = COUNTS["trainable"] / 2
    assert parts["cpu_adam"] == pytest.approx(28 * shard / 51.2e9)
    assert parts["gradient_and_parameter_copies"] == pytest.approx(2 * 4 * shard / at.PCIE4_X16)
    assert parts["parameter_fetches"] == pytest.approx(2 * 1 * COUNTS["total"] * 2 / 2 / at.PCIE4_X16)


def _ranked(link, estimates_keys=tuple(at.ROW_SPECS)):
    estimates = [{"key": k, "total_bytes": 1} for k in estimates_keys if k != "fsdp"]
    return at.rank_box(SHAPE, COUNTS, {**WORKLOAD, "grad_accum": 4}, [RTX3090, RTX3090], link, estimates, 2, "none")


def test_over_one_gigabit_communication_decides_and_the_least_communicating_strategy_wins():
    time = _ranked("ethernet-1g")
    order = [r["key"] for r in time["ranking"]]
    # DDP and ZeRO-1 send the gradients' bytes once per step; ZeRO-2 all-reduces them every
    # micro-batch and ZeRO-3 gathers the parameters every micro-batch (as DeepSpeed 0.19 does in a
    # profiled step, tests/test_step_time_bytes.py): both send more.
    assert set(order[:2]) == {"ddp", "zero1"}
    assert order.index("zero1") < order.index("zero2") and order.index("zero1") < order.index("zero3")
    zero3 = next(r for r in time["ranking"] if r["key"] == "zero3")
    assert zero3["decides"] == "communication" and "over 1 Gbit/s Ethernet" in zero3["sentence"]
    assert time["decides"].startswith("communication decides the ranking") and "over 1 Gbit/s" in time["decides"]
    assert zero3["behind"].startswith("+") and "communication against" in zero3["behind"]


def test_on_nvswitch_the_same_strategies_are_compute_bound_and_offload_ranks_last():
    time = _ranked("nvswitch-h100")
    assert time["ranking"][-1]["key"] == "zero3-offopt-offparam"
    fast = _ranked("nvswitch-h100")["ranking"][0]
    slow = next(r for r in _ranked("ethernet-1g")["ranking"] if r["key"] == fast["key"])
    assert fast["step_time_s"] < slow["step_time_s"]


def test_only_strategies_that_fit_are_ranked_and_qlora_rows_distlab_refuses_are_named():
    time = _ranked("pcie", ("ddp", "zero1"))
    assert [r["key"] for r in time["ranking"]] == sorted(["ddp", "zero1"], key=lambda k: next(
        r["step_time_s"] for r in time["ranking"] if r["key"] == k))
    qlora = at.rank_box(SHAPE, COUNTS, {**WORKLOAD, "method": "qlora"}, [RTX3090, RTX3090], "pcie4",
                        [{"key": "ddp", "total_bytes": 1}, {"key": "zero3", "total_bytes": 1}], 2, "none")
    assert [r["key"] for r in qlora["ranking"]] == ["ddp"]
    assert {r["key"] for r in qlora["not_predicted"]} == {"zero3", "fsdp"}
    assert at.rank_box(SHAPE, COUNTS, WORKLOAD, [RTX3090], "measured", [], 1, "none") is None


def test_every_constant_link_board_and_reference_names_its_source():
    for table in (at.CONSTANTS, at.INTERCONNECTS, at.BOARDS):
        assert all(len(v["source"]) > 20 for v in table.values())
    for ref in at.REFERENCES:
        assert ref["source"] and ref["by"] and ref["metric"] and ref["value"] is not None
        assert "http" in ref["source"] or "NVIDIA/" in ref["source"]
    for name in at.BOARDS:
        assert gpu_peak(name, "bf16")[0], name


@pytest.fixture(scope="module")
def h100_advice():
    import distlab.configuration.tokenizer_checks
    from distlab.configuration.config import load
    from distlab.tools import advisor

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # presets name their model folders relative to the repository
        mp.setattr(distlab.configuration.tokenizer_checks, "check_tokenizer", lambda config: None)
        raw = yaml.safe_load((REPO / "config" / "presets" / "box-8xh100-llama3-8b-full.yaml").read_text())
        config, _ = load(raw, gpu_count=8)
        model = json.loads((REPO / config["model"]["path"] / "config.json").read_text())
        return json.loads(json.dumps(advisor.advise(model, {"machine": "box", "gpus": []}, config)))  # as advice.json


def test_the_h100_box_advice_shows_its_ranking_and_the_published_references(h100_advice):
    from distlab.tools import advisor

    advice = h100_advice
    ranking = advice["time"]["ranking"]
    assert ranking and [r["step_time_s"] for r in ranking] == sorted(r["step_time_s"] for r in ranking)
    assert "ddp" not in {r["key"] for r in ranking}  # 8B full fine-tuning does not fit one H100
    md = advisor.render_markdown(advice)
    assert "## Time ranking on" in md and "NVLink 4 / NVSwitch" in md and "behind the fastest by" in md
    assert "decides the ranking" in md
    assert "Published references beside the prediction (measured by others" in md
    assert "| Llama 3.1 8B | 8x H100 SXM" in md and "5762" in md
    ref = next(r for r in advice["time"]["references"] if r.get("row") == "fsdp")
    assert ref["ratio"] == pytest.approx(ref["predicted"] / 5762)
    assert any(r.startswith("fastest of those that fit on this box") for r in advice["reasons"])


def test_the_report_advisor_card_shows_the_ranking_and_the_references_of_a_checked_advice_json(h100_advice):
    from distlab.report.build import advisor_card
    from distlab.report.collect import check_schema

    check_schema(h100_advice, "advice", "advice.json")
    card = advisor_card({"box": h100_advice}, [])
    titles = [t.title for t in card.tables]
    ranking = next(t for t in card.tables if t.title.startswith("Time ranking of the box advised on box"))
    assert list(ranking.frame["predicted step s"]) == sorted(ranking.frame["predicted step s"])
    refs = next(t for t in card.tables if t.title.startswith("Published references"))
    assert "measured by others" in refs.how and refs.frame["source"].str.contains("torchtitan").any(), titles


def test_a_reference_on_another_model_is_listed_but_not_compared():
    time = _ranked("nvswitch-h100")
    titan = next(r for r in time["references"] if r.get("row") == "fsdp")
    assert "predicted" not in titan and titan["note"] == "another model than this box's: not compared"

"""The advisor for a real box: named devices of unequal size, their link, and this machine's
measured cards as evidence (distlab/tools/advisor_box.py)."""
import json
from pathlib import Path

from distlab.tools import advisor

REPO = Path(__file__).resolve().parent.parent
# A ~1.3B Llama (the 7B preset's config, narrower and shallower): LoRA in bf16 fits a 12 GiB card.
LLAMA1B = dict(json.loads((REPO / "config" / "presets" / "models" / "llama-2-7b" / "config.json").read_text()),
               hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=16)
BOX = [{"name": "RTX 4090", "memory_gib": 24, "tflops": 165}, {"name": "RTX 3060", "memory_gib": 12, "tflops": 51}]


def advise(interconnect, devices=BOX, collectives=None, evidence=None, **defaults):
    cfg = {"advisor": {"devices": devices, "interconnect": interconnect, "headroom": 0.1},
           "defaults": {"precision": "bf16", "method": "lora", "seq_len": 512, **defaults}}
    return advisor.advise(LLAMA1B, {"machine": "box", "gpus": []}, cfg, collectives=collectives, evidence=evidence)


def test_a_4090_beside_a_3060_over_pcie_is_limited_by_the_3060_and_sized_batches_recover_it():
    advice = advise("pcie", micro_batch=16)
    reasons = " ".join(advice["reasons"])
    assert advice["devices"]["smallest_bytes"] == 12 * 2**30  # 16 per device fits neither: the box plan sizes it
    assert f"the smallest (RTX 3060, 12 GiB) holds: {advice['box']['plan']['uniform_micro_batch']} of the 16 asked" \
        in reasons
    assert "no NVLink: avoid tensor and pipeline parallel" in reasons and "interconnect: pcie" in reasons
    plan = advice["box"]["plan"]
    fast, slow = plan["max_samples_per_device"]
    assert fast > slow >= plan["uniform_micro_batch"] >= 1  # the 4090 holds more than the uniform share
    sized = plan["sized_micro_batch"]
    assert plan["uniform_micro_batch"] < 16 and sized[0] > sized[1] and sized[1] <= slow  # within each memory
    assert sum(sized) > 2 * plan["uniform_micro_batch"]  # more of the asked batch than uniform DDP keeps
    assert plan["predicted_gain"] > 1 and "sized batches recover it" in reasons
    assert "| RTX 4090 | 24 |" in advisor.render_markdown(advice)


def test_nvlink_allows_tensor_parallel_and_a_measured_link_is_classified_by_its_busbw():
    assert not any("avoid tensor" in r for r in advise("nvlink")["reasons"])
    slow = {"results": [{"op": "all_reduce", "status": "ok", "backend": "nccl", "size_bytes": 1 << 29,
                         "busbw_bytes_per_s": 22e9}]}
    advice = advise("measured", collectives=slow)
    assert not advice["devices"]["nvlink"] and any("22.0 GB/s (nccl" in r and "PCIe-class" in r
                                                   for r in advice["reasons"])
    fast = {"results": [dict(slow["results"][0], busbw_bytes_per_s=350e9)]}
    assert advise("measured", collectives=fast)["devices"]["nvlink"]


def test_the_measured_cards_are_quoted_as_evidence():
    evidence = {"unequal": {"pairs": [{"devices": "rank 0: 1 thread / rank 1: 1 thread", "uniform": [4, 4],
                                       "sized": [6, 2], "speedup": 1.41, "clear": True}]},
                "links": {"strategies": {"TP": {"stops_paying": "stops paying between 100m and 1g",
                                                "break_even_mbit": 420.0}},
                          "busbw_gbit": {"100m": 0.09}}}
    lines = advise("pcie", evidence=evidence)["box"]["evidence"]
    assert any("sized batches [6, 2] ran 1.41x the tokens/s of uniform [4, 4]" in line for line in lines)
    assert any("TP stops paying between 100m and 1g; break-even ~420 Mbit/s" in line for line in lines)

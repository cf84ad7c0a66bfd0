"""The advisor for a real box: named devices of unequal size and speed, how they are linked,
and what this machine measured about both (distlab.tools.advisor calls it).

`advisor.devices: [{name: RTX 4090, memory_gib: 24, tflops: 165}, {name: RTX 3060, memory_gib: 12}]`
with `advisor.interconnect: pcie | nvlink | measured`. It answers by the roadmap's table:
- GPUs of different sizes: uniform DDP gives every device the micro-batch the smallest holds
  ("the smaller one limits"); batches sized per device (`rank_micro_batch`, distlab/runtime/unequal.py)
  let each hold what it can, in proportion to its speed (tflops, when given) within its memory;
- PCIe (~32 GB/s) against NVLink (~900 GB/s): without NVLink, no tensor or pipeline parallel;
  data parallel or ZeRO (`measured` classifies the link by the all-reduce busbw of this
  machine's collectives.json: NVLink-class from 100 GB/s);
- the model does not fit: ZeRO-3, then CPU offload (distlab.tools.advisor's rows).
Evidence: the measured cards of this machine (`snakemake links`, `snakemake unequal`), when
they exist, are quoted with their figures: how much sized batches gained on unequal ranks, where
each strategy stopped paying as the link slowed.
"""
from __future__ import annotations

import math

from distlab.configuration.config_links import split_batch  # the advisor predicts with the same split the ranks run

GIB = 2**30
NVLINK_CLASS_BUSBW = 100e9  # bytes/s: above any PCIe 4.0/5.0 x16 link (~32 / ~64 GB/s), below NVLink


def measured_interconnect(collectives: dict | None) -> tuple[bool | None, str]:
    """(NVLink-class?, why) from a collectives.json: the all-reduce busbw of its largest message."""
    if not collectives:
        return None, "interconnect 'measured' but no collectives.json of this machine (rule collectives)"
    rows = [r for r in collectives["results"] if r["op"] == "all_reduce" and r["status"] == "ok"]
    backend = "nccl" if any(r["backend"] == "nccl" for r in rows) else "gloo"
    rows = [r for r in rows if r["backend"] == backend]
    if not rows:
        return None, "collectives.json holds no measured all-reduce"
    big = max(rows, key=lambda r: r["size_bytes"])
    busbw = big["busbw_bytes_per_s"]
    return busbw >= NVLINK_CLASS_BUSBW, (f"measured all-reduce busbw {busbw / 1e9:.1f} GB/s ({backend}, "
                                         f"{big['size_bytes'] / 2**20:.0f} MiB, collectives.json): "
                                         f"{'NVLink' if busbw >= NVLINK_CLASS_BUSBW else 'PCIe'}-class")


def sized_batches(devices: list[dict], usable: list[float], state_bytes: float, per_sample: float,
                  uniform: int) -> dict:
    """Uniform vs sized micro-batches on these devices, from memory (and speed when given).

    Each device holds at most floor((usable - model state) / activation bytes per sample)
    samples. Uniform DDP: every device at most the smallest's count. Sized: as much of the asked
    global batch (micro_batch x devices) as they hold together, split in proportion to tflops
    (to memory when not given), each within its own memory. The predicted gain is compute only:
    samples per step over the slowest device's step time, sized against uniform."""
    fits = [max(0, math.floor((u - state_bytes) / per_sample)) for u in usable]
    speeds = [d.get("tflops") for d in devices]
    known = all(speeds)
    uniform_batch = min(uniform, min(fits))
    out = {"max_samples_per_device": fits, "uniform_micro_batch": uniform_batch, "speeds_known": known}
    if uniform_batch < 1:
        out["note"] = "a micro-batch of 1 does not fit the smallest device: no data-parallel plan"
        return out
    # Sized: as much of the asked global batch as the devices hold together, split by speed
    # (by memory when speeds are not given), each device within its own memory.
    total = min(sum(fits), uniform * len(devices))
    sizes = split_batch(total, speeds if known else [float(f) for f in fits], fits)
    out["sized_micro_batch"] = sizes
    if known:
        def per_second(batch):  # samples per unit of time: the slowest device sets the step
            return sum(batch) / max(b / s for b, s in zip(batch, speeds))

        out["predicted_gain"] = per_second(sizes) / per_second([uniform_batch] * len(devices))
    return out


def evidence_lines(evidence: dict) -> list[str]:
    """The measured cards' figures, quoted."""
    lines = []
    unequal = evidence.get("unequal") or {}
    for pair in unequal.get("pairs", []):
        lines.append(f"measured here (unequal card): on {pair['devices']}, sized batches {pair['sized']} ran "
                     f"{pair['speedup']:.2f}x the tokens/s of uniform {pair['uniform']}"
                     + ("" if pair["clear"] else " (within the noise)"))
    link = evidence.get("links") or {}
    for name, found in sorted(link.get("strategies", {}).items()):
        star = found.get("break_even_mbit")
        lines.append(f"measured here (link card): {name} {found['stops_paying']}"
                     + (f"; break-even ~{star:,.0f} Mbit/s at this CPU's speed" if star else ""))
    if link.get("busbw_gbit"):
        lines.append("measured here (link card): all-reduce busbw " + ", ".join(
            f"{cap} {bw} Gbit/s" for cap, bw in link["busbw_gbit"].items()))
    return lines


def box_advice(advice: dict, devices: list[dict], per_sample: float, state_bytes: float, headroom: float,
               micro_batch: int, evidence: dict) -> dict:
    """The per-device table, the sized-batch plan and the reasons a box of unequal devices adds."""
    usable = [d["memory_gib"] * GIB * (1 - headroom) for d in devices]
    plan = sized_batches(devices, usable, state_bytes, per_sample, micro_batch)
    reasons = []
    unequal = len({d["memory_gib"] for d in devices}) > 1 or len({d.get("tflops") for d in devices}) > 1
    if unequal:
        small = min(devices, key=lambda d: d["memory_gib"])
        if plan["uniform_micro_batch"] < micro_batch:
            reasons.append(f"uniform DDP gives every device the micro-batch the smallest ({small.get('name', '?')}, "
                           f"{small['memory_gib']:g} GiB) holds: {plan['uniform_micro_batch']} of the "
                           f"{micro_batch} asked")
        else:
            reasons.append(f"every device holds the asked micro-batch ({micro_batch}), but uniform DDP paces them all "
                           "at the slowest one's speed: the faster waits at every all-reduce")
        if plan.get("sized_micro_batch"):
            gain = plan.get("predicted_gain")
            reasons.append(f"sized batches recover it: rank_micro_batch {plan['sized_micro_batch']} (each device "
                           f"within its memory{', in proportion to its tflops' if plan['speeds_known'] else ''})"
                           + (f", predicted {gain:.2f}x the uniform throughput" if gain else
                              "; give each device's tflops, or rank_micro_batch: auto, to size by speed"))
    rows = [{"device": d.get("name", f"device {i}"), "memory GiB": d["memory_gib"], "tflops": d.get("tflops"),
             "max micro-batch": plan["max_samples_per_device"][i],
             "uniform": plan["uniform_micro_batch"],
             "sized": (plan.get("sized_micro_batch") or [None] * len(devices))[i]} for i, d in enumerate(devices)]
    return {"devices": rows, "plan": plan, "reasons": reasons, "evidence": evidence_lines(evidence)}


def measured_evidence(machine_dir) -> dict:
    """The link and unequal cards' card.json of one machine's results folder, where they exist
    (the advisor quotes them for a box of devices)."""
    import json
    import os

    found = {}
    for name in ("links", "unequal"):
        path = os.path.join(machine_dir, name, "card.json")
        if os.path.isfile(path):
            with open(path) as fh:
                found[name] = json.load(fh)
    return found

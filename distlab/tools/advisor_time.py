"""Time ranking for a named box: each strategy the advisor fits in memory, its step time
predicted with step_time's four terms from cited tables (no machine of the box is at hand):

    step = compute + exposed communication + optimizer (and offload) + bubble

- compute: the step's FLOPs per rank (distlab.records.metrics.flops_per_token: 6N full, 4N_frozen +
  6N_trainable with adapters, plus attention; the recomputed forward under activation
  checkpointing) over the board's dense datasheet peak at the run's precision
  (distlab.configuration.hardware.GPU_PEAKS) times an achievable fraction that others measured
  (CONSTANTS). On unequal boards every rank gets the same micro-batch: the slowest sets the step.
- communication: the bytes and calls of distlab.tools.step_collectives.collectives_per_step, each call
  latency + size x nccl-tests' bus factor / the link's bus bandwidth (INTERCONNECTS);
  ZeRO-3/FSDP gather an adapter run's frozen base too. Exposed: DDP's
  buckets hide behind the backward except the last one; the others are counted whole.
- optimizer: AdamW's bytes over the board's memory bandwidth; with optimizer offload, CPU Adam's
  bytes over the host's memory bandwidth and the gradient/parameter copies over the board's host
  link; with parameter offload, the partition fetched over that link in every forward and backward.
- bubble: none (no row here pipelines).

Every number comes from CONSTANTS, INTERCONNECTS, BOARDS or hardware.GPU_PEAKS with its source;
none is fitted to a run. REFERENCES holds figures others measured, shown beside the predictions.
Torch-free arithmetic on the advisor's counts (distlab.tools.advisor calls rank_box).
"""
from __future__ import annotations

from distlab.records.advice import label
from distlab.records.metrics import flops_per_token
from distlab.records.spec import Spec
from distlab.tools.collectives import BUSBW_FACTOR
from distlab.configuration.hardware import gpu_peak
from distlab.tools.step_collectives import collectives_per_step

GB = 1e9
TORCHTITAN_BENCH = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
                    "(https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md)")
NCCL_212 = "NVIDIA/nccl-tests#212, sjeaugey (https://github.com/NVIDIA/nccl-tests/issues/212)"

# Every scalar the prediction uses, with where it comes from.
CONSTANTS = {
    "achievable_fraction": {
        "value": 0.33, "unit": "of the dense bf16 peak",
        "source": f"{TORCHTITAN_BENCH}: Llama 3.1 8B, FSDP on 8 or 128 H100s without Float8, '33% to 39% MFU' "
                  "without and with torch.compile (distlab runs eager unless compile: true); measured by others on "
                  "H100, applied to every board (the GPU kit has measured no fraction yet)"},
    "achievable_fraction_compiled": {
        "value": 0.39, "unit": "of the dense bf16 peak",
        "source": f"{TORCHTITAN_BENCH}: the same runs with torch.compile"},
    "nccl_effective_fraction": {
        "value": 370 / 450, "unit": "of the link's line rate",
        "source": f"{NCCL_212}: NVLink4's 450 GB/s line rate gives NCCL ~370 GB/s effective bandwidth (~20% "
                  "protocol overhead); used only to derive a bus bandwidth from a line rate where no nccl-tests "
                  "figure for the link was found"},
    "adamw_bytes_per_param": {
        "value": 28, "unit": "bytes",
        "source": "AdamW reads fp32 parameter, gradient, exp_avg, exp_avg_sq (16 B) and writes parameter, exp_avg, "
                  "exp_avg_sq (12 B): torch.optim.AdamW's update, memory-bound"},
    "host_memory_bandwidth": {
        "value": 51.2 * GB, "unit": "bytes/s",
        "source": "DDR4-3200, two channels: 3200 MT/s x 8 bytes x 2 (JEDEC JESD79-4); the CPU Adam of optimizer "
                  "offload taken as memory-bound on it (a lower bound on its time: no published CPU Adam rate for "
                  "these hosts was found)"},
}

# Board figures beyond the FLOP peaks: memory bandwidth and the host link (per direction).
PCIE4_X16 = 16e9 * 16 / 8 * 128 / 130  # 16 GT/s x 16 lanes, 128b/130b: 31.5 GB/s per direction
PCIE5_X16 = 2 * PCIE4_X16
BOARDS = {
    "NVIDIA GeForce RTX 3090": {"memory_bandwidth": 936 * GB, "host_link": PCIE4_X16,
                                "source": "NVIDIA GeForce RTX 3090 specifications (936 GB/s GDDR6X); PCIe 4.0 x16"},
    "NVIDIA GeForce RTX 4090": {"memory_bandwidth": 1008 * GB, "host_link": PCIE4_X16,
                                "source": "NVIDIA Ada (AD102) whitepaper (1008 GB/s GDDR6X); PCIe 4.0 x16"},
    "NVIDIA GeForce RTX 3060": {"memory_bandwidth": 360 * GB, "host_link": PCIE4_X16,
                                "source": "NVIDIA GeForce RTX 3060 specifications (360 GB/s GDDR6, 12 GB); "
                                          "PCIe 4.0 x16"},
    "NVIDIA H100 80GB HBM3": {"memory_bandwidth": 3350 * GB, "host_link": PCIE5_X16,
                              "source": "H100 SXM5 datasheet (3.35 TB/s HBM3; PCIe Gen5 128 GB/s both directions)"},
    "NVIDIA A100-SXM4-80GB": {"memory_bandwidth": 2039 * GB, "host_link": PCIE4_X16,
                              "source": "A100 datasheet (80 GB SXM: 2,039 GB/s; PCIe Gen4 64 GB/s both directions)"},
    "NVIDIA L40S": {"memory_bandwidth": 864 * GB, "host_link": PCIE4_X16,
                    "source": "L40S datasheet (864 GB/s GDDR6; PCIe Gen4 x16)"},
}
PCIE_SOURCE = "PCI Express 4.0 base specification: 16 GT/s per lane, 128b/130b encoding (x16: 31.5 GB/s per direction)"

# How the box's devices are linked: nccl-tests bus bandwidth per collective (bytes/s) and the
# latency of one call. derived: no nccl-tests figure for this link was found; line rate x
# CONSTANTS['nccl_effective_fraction'].
_EFF = CONSTANTS["nccl_effective_fraction"]["value"]
INTERCONNECTS = {
    "pcie4": {"label": "PCIe 4.0 x16", "nvlink": False,
              "busbw": dict.fromkeys(BUSBW_FACTOR, PCIE4_X16 * _EFF), "latency_s": 42.14e-6,
              "source": f"derived: {PCIE_SOURCE} x the NCCL effective fraction; latency: the 8-byte all_reduce "
                        "time of 8 RTX 4090 over PCIe in NVIDIA/nccl#1530 (42.14 us)"},
    "nvlink3": {"label": "NVLink 3 bridge (2x RTX 3090)", "nvlink": True,
                "busbw": dict.fromkeys(BUSBW_FACTOR, 56.25e9 * _EFF), "latency_s": 13.39e-6,
                "source": "derived: NVIDIA GeForce RTX 3090 specifications, NVLink bridge 112.5 GB/s total "
                          "(56.25 GB/s per direction) x the NCCL effective fraction; latency: the 32 KiB all_reduce "
                          "time over a 2x RTX 2080 Ti NVLink bridge in NVIDIA/nccl-tests#44 (13.39 us)"},
    "nvswitch-h100": {"label": "NVLink 4 / NVSwitch (8x H100 SXM)", "nvlink": True,
                      "busbw": {"all_reduce": 480e9, "all_gather": 370e9, "reduce_scatter": 370e9},
                      "latency_s": 13.39e-6,
                      "source": f"{NCCL_212}: ~480 GB/s all_reduce busbw on 8 GPUs (NVLink SHARP), ~370 GB/s for the "
                                "other collectives; latency as nvlink3 (no small-message H100 figure found)"},
    "ethernet-1g": {"label": "1 Gbit/s Ethernet (home PC + cloud box)", "nvlink": False,
                    "busbw": dict.fromkeys(BUSBW_FACTOR, 0.125e9), "latency_s": 0.0,
                    "source": "IEEE 802.3ab 1000BASE-T line rate (125 MB/s), an upper bound on the bus bandwidth; "
                              "per-call latency not counted (it depends on the path between the two sites): the "
                              "communication term is a lower bound"},
}
ALIASES = {"pcie": "pcie4"}  # advisor.interconnect: pcie keeps meaning a PCIe 4.0 box

# Figures measured by others, shown beside the predictions (never inputs, except where `input` says so).
REFERENCES = [
    {"model": "Llama 3.1 8B", "hardware": "8x H100 SXM (96 GB HBM2e, 500 W), NVLink", "strategy": "FSDP",
     "metric": "tokens/s per device", "value": 5762,
     "setup": "local batch 2, global 16, selective activation checkpointing, bf16, eager; seq_len 8192 "
              "(train_configs/llama3_8b.toml at torchtitan 9dec370, the benchmark's commit)",
     "source": f"{TORCHTITAN_BENCH}, Table 1", "by": "measured by others (torchtitan team, 2024-12)",
     "box": "nvswitch-h100", "row": "fsdp",
     "shape": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "vocab_size": 128256},
     "note": "the achievable fraction (33%) comes from the same runs: the ratio checks the other terms only"},
    {"model": "Llama 3.1 8B", "hardware": "8x H100 SXM (96 GB HBM2e, 500 W), NVLink",
     "strategy": "FSDP + torch.compile",
     "metric": "tokens/s per device", "value": 6667, "setup": "as above, torch.compile",
     "source": f"{TORCHTITAN_BENCH}, Table 1", "by": "measured by others (torchtitan team, 2024-12)"},
    {"model": "Llama 3.1 8B", "hardware": "8 or 128 H100", "strategy": "FSDP", "metric": "MFU", "value": "0.33-0.39",
     "setup": "without Float8; without / with torch.compile", "source": TORCHTITAN_BENCH,
     "by": "measured by others (torchtitan team)", "input": "achievable_fraction"},
    {"model": "IBM Granite 7B (Llama 2 architecture)", "hardware": "4x A100",
     "strategy": "FSDP full shard (aligned mode)",
     "metric": "tokens/s per device", "value": 3158.7, "setup": "batch size 8, bf16; step 10.4 s, MFU 0.41",
     "source": "Hugging Face blog, 'A Hugging Face Accelerate Story of Multiple Backends: FSDP and DeepSpeed', "
               "Table 3 (https://huggingface.co/blog/deepspeed-to-fsdp-and-back)",
     "by": "measured by others (IBM Research / Hugging Face, 2024-06)",
     "note": "no preset box is 4x A100, and the blog does not name the A100 variant, link or sequence length: not "
             "predicted"},
    {"model": "IBM Granite 7B (Llama 2 architecture)", "hardware": "4x A100", "strategy": "DeepSpeed ZeRO-3",
     "metric": "tokens/s per device", "value": 3094.5, "setup": "batch size 8, bf16; step 10.6 s, MFU 0.40",
     "source": "Hugging Face blog, 'A Hugging Face Accelerate Story of Multiple Backends: FSDP and DeepSpeed', "
               "Table 3 (https://huggingface.co/blog/deepspeed-to-fsdp-and-back)",
     "by": "measured by others (IBM Research / Hugging Face, 2024-06)", "note": "as above: not predicted"},
    {"model": "-", "hardware": "8x H100 SXM, NVSwitch", "strategy": "all_reduce (NVLink SHARP)", "metric": "busbw GB/s",
     "value": 476, "setup": "nccl-tests all_reduce_perf, one node",
     "source": "NVIDIA/nccl-tests#290, AddyLaddy: '476GB/s looks to be in the expected range for H100' "
               "(https://github.com/NVIDIA/nccl-tests/issues/290)",
     "by": "measured by others", "box": "nvswitch-h100", "busbw_op": "all_reduce"},
    {"model": "-", "hardware": "8x H100 SXM, NVSwitch", "strategy": "ring collectives", "metric": "busbw GB/s",
     "value": 370, "setup": "NCCL effective NVLink bandwidth (NCCL_ALGO=RING or non-all-reduce)",
     "source": NCCL_212, "by": "NVIDIA's NCCL maintainer", "box": "nvswitch-h100", "busbw_op": "all_gather",
     "input": "INTERCONNECTS['nvswitch-h100']"},
    {"model": "-", "hardware": "2x RTX 2080 Ti, NVLink bridge (NVLink 2)", "strategy": "all_reduce",
     "metric": "busbw GB/s",
     "value": 21.4, "setup": "nccl-tests all_reduce_perf, 64 MiB, out-of-place",
     "source": "NVIDIA/nccl-tests#44 (https://github.com/NVIDIA/nccl-tests/issues/44)", "by": "measured by others",
     "note": "the nearest bridge measurement found; no nccl-tests figure for 2x RTX 3090 NVLink or 2 GPUs on PCIe "
             "4.0 x16 was found"},
]


def board(name: str | None) -> str | None:
    """The NVML name of a device named in advisor.devices ('RTX 3090' or 'NVIDIA GeForce RTX 3090')."""
    if not name:
        return None
    for candidate in (name, f"NVIDIA GeForce {name}", f"NVIDIA {name}"):
        if gpu_peak(candidate, "fp32")[0] is not None or candidate in BOARDS:
            return candidate
    return None


def interconnect(name: str | None) -> dict | None:
    return INTERCONNECTS.get(ALIASES.get(name, name)) if name else None


# The advisor's rows as distlab runs them (step_time's spec keys), and FSDP beside ZeRO-3.
ROW_SPECS = {
    "ddp": ("ddp", {}),
    "zero1": ("deepspeed", {"zero_stage": 1}),
    "zero2": ("deepspeed", {"zero_stage": 2}),
    "zero3": ("deepspeed", {"zero_stage": 3}),
    "fsdp": ("fsdp", {}),
    "zero3-offopt": ("deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu"}),
    "zero3-offopt-offparam": ("deepspeed", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
}


def step_spec(key: str, workload: dict, n: int) -> Spec:
    strategy, ds = ROW_SPECS[key]
    return Spec({"world_size": n, "strategy": strategy, "grad_accum": workload.get("grad_accum", 1),
            "micro_batch": workload["micro_batch"], "seq_len": workload["seq_len"], "precision": workload["precision"],
            "method": workload["method"], "deepspeed": {"zero_stage": 0, **ds},
            "fsdp": {"reshard_after_forward": True, "cpu_offload": False}, "pp": {"microbatches": 1}})


def compute_flops(shape: dict, counts: dict, workload: dict, checkpointing: str) -> dict:
    """FLOPs one rank computes per optimizer step."""
    embedding = 0 if shape.get("tie_word_embeddings") else counts["embedding"]
    adapters = workload["method"] in ("lora", "qlora")
    seq, layers = workload["seq_len"], shape["num_hidden_layers"]
    per_token = flops_per_token(counts["total"], embedding, layers, shape["num_attention_heads"], shape["head_dim"],
                                seq, n_trainable=counts["trainable"] if adapters else None)
    # The recomputed forward: 2 FLOPs per matmul weight and 4*L*H*Dh*S of attention per token, for
    # every layer (full) or every k-th (selective: distlab.runtime.activations' every-k layers).
    forward_layers = (2 * (counts["total"] - embedding - counts.get("lm_head", 0)) / max(1, layers)
                      + 4 * shape["num_attention_heads"] * shape["head_dim"] * seq)
    every = workload.get("activation_checkpointing_every", 2)
    recomputed = {"full": layers, "selective": layers // max(1, every)}.get(checkpointing, 0)
    tokens = workload["micro_batch"] * seq * workload.get("grad_accum", 1)
    return {"flops": tokens * (per_token + recomputed * forward_layers), "tokens": tokens, "per_token": per_token,
            "recomputed_layers": recomputed}


def collective_time(op: str, size: float, n: int, link: dict) -> float:
    return link["latency_s"] + size * BUSBW_FACTOR[op](n) / link["busbw"][op]


def _calls(key: str, spec: Spec, shape: dict, counts: dict, workload: dict) -> list[dict]:
    """The box's collectives: step_time's (ZeRO-3 and FSDP gather a LoRA run's frozen base too)."""
    return collectives_per_step(spec, shape, counts)


def predict_row(key: str, shape: dict, counts: dict, workload: dict, devices: list[dict], link: dict,
                checkpointing: str, compiled: bool = False) -> dict:
    """One strategy's step on the box: the four terms, each with its inputs named."""
    n = len(devices)
    spec = step_spec(key, workload, n)
    precision = workload["precision"] if workload["precision"] in ("bf16", "fp16") else "tf32"
    frac_key = "achievable_fraction_compiled" if compiled else "achievable_fraction"
    fraction = CONSTANTS[frac_key]["value"]
    flops = compute_flops(shape, counts, workload, checkpointing)
    per_device = []
    for d in devices:
        name = board(d.get("name"))
        peak, source = gpu_peak(name, precision) if name else (None, None)
        if peak is None:
            return {"key": key, "status": "not predicted",
                    "why": f"no datasheet peak for {d.get('name')!r} at {precision} in hardware.GPU_PEAKS"}
        per_device.append({"device": d.get("name"), "board": name, "peak": peak, "source": source,
                           "seconds": flops["flops"] / (peak * fraction)})
    slowest = max(per_device, key=lambda p: p["seconds"])
    recompute = f" + {flops['recomputed_layers']} recomputed layer forwards" if flops["recomputed_layers"] else ""
    unequal = len({p["board"] for p in per_device}) > 1
    compute = {"seconds": slowest["seconds"],
               "how": f"{flops['flops']:.3g} FLOPs per rank ({flops['tokens']} tokens x {flops['per_token']:.3g} "
                      f"FLOPs/token{recompute}) / ({slowest['board']} {precision} peak {slowest['peak'] / 1e12:.1f} "
                      f"TFLOP/s x {fraction:.2f})" + ("; the slowest device sets the step" if unequal else "")}
    rows, total = [], 0.0
    for c in _calls(key, spec, shape, counts, workload):
        seconds = c["calls"] * collective_time(c["op"], c["bytes"], n, link)
        rows.append({**c, "seconds": seconds})
        total += seconds
    if key == "ddp" and rows:
        backward = compute["seconds"] * 2 / 3
        exposed = max(rows[-1]["seconds"], total - backward)
        overlap = "DDP's buckets overlap the backward; the last bucket is exposed"
    else:
        exposed, overlap = total, "not overlapped"
    comm = {"seconds": exposed, "total_s": total, "bytes": sum(r["bytes"] * r["calls"] for r in rows), "calls": rows,
            "how": f"{sum(r['calls'] for r in rows)} call(s), {sum(r['bytes'] * r['calls'] for r in rows) / 1e9:.2f} "
                   f"GB over {link['label']} ({overlap})"}
    ds = spec.deepspeed
    sharded = key != "ddp"
    trained = counts["trainable"] / (n if sharded else 1)
    adam_bytes = CONSTANTS["adamw_bytes_per_param"]["value"] * trained
    host = min(BOARDS.get(p["board"], {}).get("host_link", PCIE4_X16) for p in per_device)
    membw = min(BOARDS[p["board"]]["memory_bandwidth"] for p in per_device if p["board"] in BOARDS) \
        if any(p["board"] in BOARDS for p in per_device) else None
    parts = {}
    if ds.get("offload_optimizer"):
        parts["cpu_adam"] = adam_bytes / CONSTANTS["host_memory_bandwidth"]["value"]
        parts["gradient_and_parameter_copies"] = 2 * 4 * trained / host
    elif membw is None:
        return {"key": key, "status": "not predicted",
                "why": "no memory bandwidth for these boards (advisor_time.BOARDS)"}
    else:
        parts["adamw"] = adam_bytes / membw
    if ds.get("offload_param"):
        module = 2 if workload["precision"] in ("bf16", "fp16") else 4
        parts["parameter_fetches"] = 2 * spec.grad_accum * counts["total"] * module / n / host
    optim = {"seconds": sum(parts.values()), "parts": parts,
             "how": ("CPU Adam over host memory + copies over the host link" if ds.get("offload_optimizer") else
                     "AdamW bytes over the board's memory bandwidth")
                    + (" + the parameter partition fetched over the host link per forward and backward"
                       if ds.get("offload_param") else "")}
    terms = {"compute": compute, "communication": comm, "optimizer": optim,
             "bubble": {"seconds": 0.0, "how": "no pipeline"}}
    step = sum(t["seconds"] for t in terms.values())
    tokens = flops["tokens"]
    return {"key": key, "status": "predicted", "step_time_s": step, "tokens_per_s_per_device": tokens / step,
            "terms": terms}


def deciding_sentence(row: dict, link: dict) -> tuple[str, str]:
    """(term, sentence): the largest term of the step, as a share of it."""
    terms = {k: v["seconds"] for k, v in row["terms"].items()}
    top = max(terms, key=terms.get)
    share = terms[top] / row["step_time_s"]
    where = {"communication": f" over {link['label']}", "compute": " on the slowest device",
             "optimizer": " (AdamW / offload)"}.get(top, "")
    return top, f"{top}: {share:.0%} of the step{where}"


def ranking_sentence(ranking: list[dict], link: dict) -> str | None:
    """The term that decides the ranking: the one whose seconds differ most between the strategies."""
    if len(ranking) < 2:
        return None
    spread = {k: max(r["terms"][k]["seconds"] for r in ranking) - min(r["terms"][k]["seconds"] for r in ranking)
              for k in ranking[0]["terms"]}
    term = max(spread, key=spread.get)
    if spread[term] <= 0:
        return "no term differs between the strategies"
    last = max(ranking, key=lambda r: r["terms"][term]["seconds"])
    where = f" over {link['label']}" if term == "communication" else ""
    return (f"{term} decides the ranking: it differs by {spread[term]:.3f} s between the strategies{where} "
            f"({last['key']}: {last['terms'][term]['seconds'] / last['step_time_s']:.0%} of its step)")


def rank_box(shape: dict, counts: dict, workload: dict, devices: list[dict], link_name: str | None,
             estimates: list[dict], usable: float, checkpointing: str) -> dict | None:
    """advice.json's `time`: the strategies that fit, fastest first, or None without a named link."""
    link = interconnect(link_name)
    if link is None:
        return None
    fits = {r["key"] for r in estimates if r["total_bytes"] <= usable}
    if "zero3" in fits:
        fits.add("fsdp")  # the zero3 row stands for ZeRO-3 and FSDP full shard (advisor.ROW_LABEL)
    from distlab.configuration.training_tools import QLORA_REFUSED

    ranking, skipped = [], []
    for key in ROW_SPECS:
        if key not in fits:
            continue
        if workload["method"] == "qlora" and ROW_SPECS[key][0] in QLORA_REFUSED:
            skipped.append({"key": key, "status": "not predicted",
                            "why": f"distlab refuses qlora under {ROW_SPECS[key][0]} (training_tools.QLORA_REFUSED)"})
            continue
        row = predict_row(key, shape, counts, workload, devices, link, checkpointing,
                          compiled=bool(workload.get("compile")))
        if row["status"] != "predicted":
            skipped.append(row)
            continue
        row["decides"], row["sentence"] = deciding_sentence(row, link)
        ranking.append(row)
    ranking.sort(key=lambda r: r["step_time_s"])
    for row in ranking[1:]:  # what puts each row behind the fastest: the term that grew most
        gaps = {k: row["terms"][k]["seconds"] - ranking[0]["terms"][k]["seconds"] for k in row["terms"]}
        term = max(gaps, key=gaps.get)
        row["behind"] = f"+{gaps[term]:.3f} s {term} against {ranking[0]['key']}"
    return {"interconnect": ALIASES.get(link_name, link_name), "link": link, "ranking": ranking,
            "decides": ranking_sentence(ranking, link),
            "not_predicted": skipped, "checkpointing": checkpointing,
            "constants": CONSTANTS, "references": references_for(ranking, ALIASES.get(link_name, link_name), shape),
            "how": __doc__.split("\n\n", 1)[1].split("\n\nEvery number", 1)[0].strip()}


def references_for(ranking: list[dict], link_name: str, shape: dict) -> list[dict]:
    """The references on this box's hardware, each with the prediction it stands beside."""
    rows = {r["key"]: r for r in ranking}
    out = []
    for ref in REFERENCES:
        if ref.get("box") != link_name:
            continue
        item = dict(ref)
        other_model = any(shape.get(k) != v for k, v in ref.get("shape", {}).items())
        if other_model:
            item["note"] = "another model than this box's: not compared"
        elif "row" in ref and ref["row"] in rows and isinstance(ref["value"], (int, float)):
            item["predicted"] = rows[ref["row"]]["tokens_per_s_per_device"]
        elif "busbw_op" in ref:
            item["predicted"] = INTERCONNECTS[link_name]["busbw"][ref["busbw_op"]] / 1e9
        if "predicted" in item:
            item["ratio"] = item["predicted"] / ref["value"]
        out.append(item)
    return out


def markdown(time: dict, box_name: str = "this box") -> list[str]:
    """advice.md's time ranking and the references beside it."""
    if not time:
        return []
    lines = ["", f"## Time ranking on {box_name} ({time['link']['label']}), fastest first", ""]
    if not time["ranking"] and not time["not_predicted"]:
        lines.append("No strategy fits in memory: nothing to rank.")
    elif not time["ranking"]:
        lines.append("No strategy that fits could be predicted:")
    else:
        lines += ["| # | strategy | predicted step s | tokens/s per device | compute s | exposed comm s | optimizer s "
                  "| largest term | behind the fastest by |", "|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(time["ranking"], 1):
            t = r["terms"]
            lines.append(f"| {i} | {label(r['key'])} | {r['step_time_s']:.3f} | {r['tokens_per_s_per_device']:,.0f} | "
                         f"{t['compute']['seconds']:.3f} | {t['communication']['seconds']:.3f} | "
                         f"{t['optimizer']['seconds']:.3f} | {r['sentence']} | {r.get('behind', '-')} |")
        first = time["ranking"][0]
        lines += ["", f"Fastest: {label(first['key'])} ({first['sentence']})."
                  + (f" {time['decides'][0].upper()}{time['decides'][1:]}." if time.get("decides") else "")]
    for r in time["not_predicted"]:
        lines.append(f"- {label(r['key'])}: not predicted ({r['why']})")
    lines += ["", "Inputs (cited, none fitted):", ""] + [
        f"- {k} = {v['value']:.3g} {v['unit']}: {v['source']}" for k, v in time["constants"].items()] + [
        "",
        f"Link: {time['link']['label']}: bus bandwidth " + ", ".join(
            f"{op} {bw / 1e9:.1f} GB/s" for op, bw in time["link"]["busbw"].items())
        + f", latency {time['link']['latency_s'] * 1e6:.1f} us per call ({time['link']['source']})."]
    if time["references"]:
        lines += ["", "Published references beside the prediction (measured by others, not on this machine):", "",
                  "| model | hardware | strategy | metric | published | predicted | predicted/published | source |",
                  "|---|---|---|---|---|---|---|---|"]
        for ref in time["references"]:
            pred = f"{ref['predicted']:,.1f}" if "predicted" in ref else "-"
            ratio = f"{ref['ratio']:.2f}" if "ratio" in ref else "-"
            lines.append(f"| {ref['model']} | {ref['hardware']} | {ref['strategy']} | {ref['metric']} | {ref['value']} "
                         f"| {pred} | {ratio} | {ref['by']}: {ref['source']}"
                         + (f"; {ref['note']}" if ref.get("note") else "") + " |")
    return lines

"""The strategy advisor: from hardware.json and a model's config.json (no weights), which
roadmap strategy to run, with the estimated memory per device of each strategy.

Rules (the roadmap's): fits one device -> DDP; does not fit -> ZeRO-3 or FSDP; still does
not fit -> CPU offload; no NVLink -> avoid tensor/pipeline parallel; GPUs of different
sizes -> planned for the smallest; several machines -> Ray Train around the strategy.

Memory = model state + activations, per device:
- Model state, Psi parameters (T trainable: all, or LoRA's adapters; the frozen rest has
  no gradient or optimizer state) over N devices, in bytes per parameter of what distlab
  itself allocates (checked against real runs' tensors within advisor_check.TOLERANCE, tests/test_advisor.py):
  - DDP / Accelerate (autocast over fp32 weights; LoRA's frozen base in bf16 when precision
    is bf16, adapters fp32): weights 4*Psi (LoRA bf16: 2*(Psi-T) + 4*T; QLoRA: 0.5 byte for
    each of the Q decoder-layer Linear weights bitsandbytes holds in 4 bits, 4 for the rest of
    the base: 0.5*Q + 4*(Psi-T-Q) + 4*T), gradients 4*T plus
    DDP's flat gradient buckets 4*T (a second copy; Accelerate adds them only at 2+
    processes, where it wraps DDP), AdamW 8*T.
  - DeepSpeed (module in bf16/fp16 when precision asks, adapters included; else fp32,
    w = 2 or 4): gradients w*T; optimizer Adam 8*T plus an fp32 master partition 4*T, also
    in fp32 runs (ZeRO 1-3: 12*T/N); ZeRO-0 fp32 keeps no master (8*T), ZeRO-0 bf16/fp16
    keeps the masters (12*T). ZeRO-1 shards the optimizer (whole gradients are held
    between accumulated micro-batches, else reduce-scattered), ZeRO-2 + gradients, ZeRO-3
    + weights (each parameter's partition padded to a multiple of N; a parameter up to the
    zero3_profile's persistence threshold is also held whole). Optimizer offload
    moves the optimizer state to CPU RAM and adds an fp32 gradient partition there
    (4*T/N); parameter offload moves the weight partitions too.
  - FSDP2 (fp32 shards; on CUDA a MixedPrecisionPolicy casts only the gathered copy):
    weights 4*Psi, gradients 4*T, AdamW 8*T, all over N (dim 0 padded to a multiple of N);
    CPUOffloadPolicy keeps all three in CPU RAM.
  - Pipeline parallel, rank 0: the embedding and the first stage's layers, 16 bytes/param.
  - Tensor parallel (full fine-tuning): 16 bytes per parameter a rank holds: the linears the
    model's tp plan splits over N (rank 0's piece of an uneven split), the rest whole.
  - Gathered: the largest unit (layer or embedding) ZeRO-3/FSDP all-gathers, transient;
    ZeRO-3's auto profile keeps a model under its live limit (1e9) gathered whole.
- Data: a rank holds only the int64 ids and labels of its micro-batch (2*8*b*s bytes); the
  token blocks stay memory-mapped (shared page cache, not a rank's own memory).
- Activations of one micro-batch (distlab.runtime.activations.estimate_activations: per token 8h +
  2*kv + 4i floats per decoder layer, h for a checkpointed one, V + 3h outside the layers;
  the layer backward recomputes on top), checked against each run's measured saved-tensor
  bytes. When the workload fits only with activation checkpointing, the advice says which.

Each strategy's byte formula lives beside it (`model_state` in
distlab/configuration/strategies/<name>_settings.py); the recommendation and the estimate-vs-measured check
(distlab.tools.advisor_check) read the same formulas through `strategy_state`; the parameter
counting they rest on is distlab.runtime.parameter_counts.
"""
from __future__ import annotations

import copy

from distlab.records.memory_phases import GIB, human, unit_for
from distlab.runtime.activations import activation_bytes
from distlab.runtime.parameter_counts import model_shape, parameter_counts, workload_counts  # noqa: F401 (advisor's API)
from distlab.configuration.strategies.settings import advisor_rows, registered

# The rows the advisor estimates and ranks, and their labels (one table: distlab/records/advice.py).
from distlab.records.advice import ROW_LABEL, ROW_ORDER  # noqa: E402,F401


def strategy_state(strategy: str, counts: dict, n: int, precision: str, lora: bool, settings: dict | None = None,
                   ) -> dict | None:
    """Bytes one rank holds for weights, gradients (DDP's buckets included) and optimizer,
    and what of it sits in CPU RAM, as distlab's `strategy` allocates it (module docstring; the
    formula is the strategy's own, in distlab/configuration/strategies/<name>_settings.py).
    None: no formula (a strategy without one, a pipeline-parallel model without layers, tensor
    parallel without a plan)."""
    known = registered().get(strategy)
    return known.model_state(counts, n, precision, lora, settings or {}) if known else None


def model_state(key: str, counts: dict, n: int, precision: str, lora: bool, grad_accum: int = 1) -> dict:
    """One advisor row's state: the strategy that row stands for (its settings' advisor_rows),
    as distlab runs it."""
    strategy, settings = advisor_rows()[key]
    out = strategy_state(strategy, counts, n, precision, lora, {**settings, "grad_accum": grad_accum})
    out.pop("cpu_parts")
    return out


def estimate(shape: dict, workload: dict, n: int, mode: str | None = None) -> list[dict]:
    """One row per strategy: estimated bytes per device for this workload on n devices
    (mode: activation checkpointing, default the workload's)."""
    lora = workload["method"] in ("lora", "qlora")
    counts = workload_counts(shape, workload)
    rows = []
    for key in ROW_ORDER:
        state = model_state(key, counts, n, workload["precision"], lora, workload.get("grad_accum", 1))
        act = activation_bytes(shape, workload, counts, mode, advisor_rows()[key][0])
        device_state = state["params"] + state["grads"] + state["optimizer"] + state["gathered"]
        data = data_bytes(workload["micro_batch"], workload["seq_len"])
        rows.append({"key": key, "strategy": ROW_LABEL[key], "devices": n, **state,
                     "model_state_bytes": device_state, "activation_bytes": act, "data_bytes": data,
                     "total_bytes": device_state + act + data})
    return rows


def data_bytes(micro_batch: int, seq_len: int) -> int:
    """What a rank holds of its data: the int64 ids and labels of the micro-batch it trains on.
    The split itself is memory-mapped Arrow (distlab.data_prep.data.TokenBlocks): page cache the OS
    shares between ranks and may evict, not memory a rank owns."""
    return 2 * 8 * micro_batch * seq_len


def plan_devices(hardware: dict, advisor_cfg: dict, cpu_ranks: int, collectives: dict | None = None) -> dict:
    """What to plan for: configured devices or GPUs, else hardware.json's GPUs, else the CPU's RAM."""
    nodes = advisor_cfg.get("nodes", 1)
    if advisor_cfg.get("devices"):  # a real box: named devices and their link (distlab.tools.advisor_box)
        from distlab.tools.advisor_box import measured_interconnect

        sizes = [d["memory_gib"] * GIB for d in advisor_cfg["devices"]]
        from distlab.tools.advisor_time import interconnect

        link = advisor_cfg.get("interconnect")
        named = interconnect(link)
        nvlink, link_how = (measured_interconnect(collectives) if link == "measured" else
                            (named["nvlink"], f"interconnect: {link} ({named['label']})") if named else
                            (link == "nvlink", f"interconnect: {link}") if link else (advisor_cfg.get("nvlink"), ""))
        source = "config advisor.devices: " + ", ".join(f"{d.get('name', '?')} {d['memory_gib']:g} GiB"
                                                         for d in advisor_cfg["devices"])
        return {"kind": "cuda", "per_node_bytes": sizes, "devices": len(sizes) * nodes, "nodes": nodes,
                "smallest_bytes": min(sizes), "uneven": max(sizes) > min(sizes) * 1.01, "nvlink": bool(nvlink),
                "source": source, "interconnect": link_how}
    if advisor_cfg.get("gpu_memory_gib"):
        sizes = [g * GIB for g in advisor_cfg["gpu_memory_gib"]]
        nvlink = advisor_cfg.get("nvlink")
        source = "config advisor.gpu_memory_gib"
        kind = "cuda"
    elif hardware.get("gpus"):
        sizes = [g["memory_total_bytes"] for g in hardware["gpus"]]
        nvlink = all(g.get("nvlink_active_links", 0) > 0 for g in hardware["gpus"])
        if advisor_cfg.get("nvlink") is not None:
            nvlink = advisor_cfg["nvlink"]
        source = f"hardware.json of {hardware.get('machine')}"
        kind = "cuda"
    else:
        ram = hardware.get("memory_total_bytes") or _local_ram_bytes()
        sizes = [ram / cpu_ranks] * cpu_ranks
        nvlink = False
        source = f"{hardware.get('machine')}: no GPU; RAM split over {cpu_ranks} CPU rank(s)"
        kind = "cpu"
    return {"kind": kind, "per_node_bytes": sizes, "devices": len(sizes) * nodes, "nodes": nodes,
            "smallest_bytes": min(sizes), "uneven": max(sizes) > min(sizes) * 1.01, "nvlink": bool(nvlink),
            "source": source}


def _local_ram_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def workload_from_config(config: dict) -> dict:
    from distlab.configuration.config import EXPERIMENT_DEFAULTS, _deep_merge

    spec = _deep_merge(EXPERIMENT_DEFAULTS, config.get("defaults", {}))
    return {k: copy.deepcopy(spec[k]) for k in ("method", "micro_batch", "grad_accum", "seq_len", "precision",
                                                   "lora", "export", "device", "activation_checkpointing",
                                                   "activation_checkpointing_every")}


def advise(model_config: dict, hardware: dict, config: dict, cpu_ranks: int = 1, collectives: dict | None = None,
           evidence: dict | None = None) -> dict:
    """collectives: this machine's collectives.json (interconnect: measured); evidence: the
    measured link / unequal cards' card.json (quoted for a box of devices)."""
    shape = model_shape(model_config)
    workload = workload_from_config(config)
    plan = plan_devices(hardware, config.get("advisor", {}), cpu_ranks, collectives)
    budget = plan["smallest_bytes"] * (1 - config.get("advisor", {}).get("headroom", 0.1))
    # The least machinery that fits, trying activation checkpointing before the next strategy:
    # recomputing the forward (~1/3 more compute) is cheaper than sharding's traffic or offload.
    chain = ["ddp", "zero3", "zero3-offopt", "zero3-offopt-offparam"]
    found = []
    for mode in dict.fromkeys([workload["activation_checkpointing"], "selective", "full"]):
        one = {r["key"]: r for r in estimate(shape, workload, 1, mode)}
        many = {r["key"]: r for r in estimate(shape, workload, plan["devices"], mode)}
        fits = {"ddp": one["ddp"]["total_bytes"] <= budget,
                **{k: many[k]["total_bytes"] <= budget for k in chain[1:]}}
        key = next((k for k in chain if fits[k]), None)
        found.append((chain.index(key) if key else len(chain), mode, key, one, many))
    _, checkpointing, pick, one, many = min(found, key=lambda f: f[0])  # min keeps the first mode of a tie
    reasons, n = [], plan["devices"]
    if pick == "ddp":
        reasons.append(f"the whole training state ({human(one['ddp']['total_bytes'])}) fits one device "
                       f"({human(budget)} usable): plain data parallel (DDP, stage 1-2) needs no sharding")
    elif pick == "zero3":
        reasons.append(f"it does not fit one device ({human(one['ddp']['total_bytes'])} > {human(budget)} usable) "
                       f"but sharded over {n} devices it does: ZeRO-3 or FSDP (stages 3-4)")
    elif pick == "zero3-offopt":
        reasons.append("even fully sharded it does not fit; with the optimizer state in CPU RAM it does: "
                       "ZeRO-3 + optimizer offload (or FSDP CPU offload)")
    elif pick == "zero3-offopt-offparam":
        reasons.append("only with parameters and optimizer state in CPU RAM: ZeRO-3 + full CPU offload "
                       f"(needs ~{many[pick]['cpu_offloaded'] / GIB:.0f} GiB of CPU RAM per device)")
    else:
        reasons.append("nothing fits, even with full CPU offload and activation checkpointing: more or larger "
                       "devices, a smaller micro-batch or sequence, LoRA, or NVMe offload (ZeRO-Infinity)")
    if pick and checkpointing != workload["activation_checkpointing"]:
        before = found[0][3]["ddp"]["activation_bytes"]
        reasons.append(f"with activation_checkpointing: {checkpointing} (activations {human(before)} -> "
                       f"{human(one['ddp']['activation_bytes'])} per micro-batch, the forward recomputed in "
                       "backward): without it this needs a heavier strategy")
    if plan["uneven"]:
        reasons.append(f"GPUs differ in size: every strategy is limited by the smallest "
                       f"({plan['smallest_bytes'] / GIB:.0f} GiB); the larger ones' extra memory sits idle")
    if n > 1 and not plan["nvlink"]:
        reasons.append("no NVLink: avoid tensor and pipeline parallel, whose per-layer transfers would cross PCIe")
    elif n > 1 and pick is None:
        reasons.append("NVLink present: tensor parallel inside the node can split what ZeRO cannot")
    if plan["nodes"] > 1:
        reasons.append(f"{plan['nodes']} machines: launch through Ray Train (stage 5) with the strategy above "
                       "inside each worker; keep sharding within a node where links are fast")
    if plan.get("interconnect"):
        reasons.append(plan["interconnect"])
    box = None
    if config.get("advisor", {}).get("devices"):
        from distlab.tools.advisor_box import box_advice

        state = (many[pick] if pick else one["ddp"])["model_state_bytes"]
        counts = workload_counts(shape, workload)
        per_sample = activation_bytes(shape, {**workload, "micro_batch": 1}, counts)  # DDP's, one sample
        box = box_advice(plan, config["advisor"]["devices"], per_sample, state,
                         config["advisor"].get("headroom", 0.1), workload["micro_batch"], evidence or {})
        reasons += box["reasons"]
    counts = workload_counts(shape, workload)
    time = None
    if config.get("advisor", {}).get("devices"):  # a named box: the strategies that fit, ranked by predicted time
        from distlab.tools.advisor_time import rank_box

        time = rank_box(shape, counts, workload, config["advisor"]["devices"], config["advisor"].get("interconnect"),
                        list(many.values()), budget, checkpointing)
        if time and time["ranking"]:
            first = time["ranking"][0]
            reasons.append(f"fastest of those that fit on this box: {first['key']} at a predicted "
                           f"{first['step_time_s']:.2f} s per step ({first['sentence']})"
                           + (f"; {time['decides']}" if time.get("decides") else ""))
    from distlab.tools.save_estimate import save_estimate

    return {"box": box, "time": time, "schema_version": 1, "model": {"shape": shape, "parameters": {
                k: v for k, v in counts.items() if not k.startswith("_")}},
            "save": save_estimate(counts, shape["vocab_size"], workload["method"] in ("lora", "qlora"),
                                  workload.get("export")),
            "workload": workload, "devices": plan, "usable_bytes_per_device": budget,
            "recommendation": pick, "recommendation_label": ROW_LABEL.get(pick, "none fits"),
            "activation_checkpointing": checkpointing,
            "reasons": reasons, "estimates": list(many.values()), "single_device": one["ddp"],
            "how": __doc__.split("Memory = ", 1)[1].strip()}


def render_markdown(advice: dict) -> str:
    plan = advice["devices"]
    lines = ["# Strategy advice", "",
             f"**Recommendation: {advice['recommendation_label']}**", ""]
    lines += [f"- {r}" for r in advice["reasons"]]
    params = advice["model"]["parameters"]
    wl = advice["workload"]
    unit, scale = unit_for(max(r["total_bytes"] for r in advice["estimates"]))
    lines += ["", f"Model: {params['total'] / 1e9:.3f} B parameters ({params['trainable'] / 1e6:.2f} M trainable); "
              f"workload: {wl['method']}, micro-batch {wl['micro_batch']} x {wl['seq_len']} tokens, {wl['precision']}.",
              f"Devices: {plan['devices']} ({plan['source']}), usable per device "
              f"{human(advice['usable_bytes_per_device'])}, NVLink: {plan['nvlink']}, nodes: {plan['nodes']}.",
              "",
              f"| strategy | params {unit} | grads {unit} | optimizer {unit} | gathered {unit} | activations {unit} | "
              f"data {unit} | total {unit}/device | CPU RAM {unit}/device | fits |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in advice["estimates"]:
        fits = "yes" if row["total_bytes"] <= advice["usable_bytes_per_device"] else "no"
        cells = [row[k] / scale for k in ("params", "grads", "optimizer", "gathered", "activation_bytes",
                                          "data_bytes", "total_bytes", "cpu_offloaded")]
        lines.append(f"| {row['strategy']} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {fits} |")
    if advice.get("save"):
        from distlab.tools.save_estimate import save_markdown

        lines += save_markdown(advice["save"], human)
    box = advice.get("box")
    if box:
        lines += ["", "| device | memory GiB | tflops | max micro-batch | uniform DDP | sized |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['device']} | {r['memory GiB']:g} | {r['tflops'] or '-'} | {r['max micro-batch']} | "
                  f"{r['uniform']} | {r['sized'] if r['sized'] is not None else '-'} |" for r in box["devices"]]
        lines += ["", "Evidence measured on this machine:"] + [f"- {e}" for e in box["evidence"] or
                                                               ["none yet: `snakemake links` and `snakemake unequal`"]]
    if advice.get("time"):
        from distlab.tools.advisor_time import markdown

        lines += markdown(advice["time"], plan["source"].removeprefix("config advisor.devices: "))
    lines += ["", "How estimated: " + " ".join(advice["how"].split()), ""]
    return "\n".join(lines)

"""The strategy advisor: from hardware.json and a model's config.json (no weights), which
roadmap strategy to run, with the estimated memory per device of each strategy.

Rules (the roadmap's): fits one device -> DDP; does not fit -> ZeRO-3 or FSDP; still does
not fit -> CPU offload; no NVLink -> avoid tensor/pipeline parallel; GPUs of different
sizes -> planned for the smallest; several machines -> Ray Train around the strategy.

Memory = model state + activations, per device:
- Model state, Psi parameters over N devices (DeepSpeed ZeRO paper / memory docs): bytes
  per parameter split into weights w, gradients g, optimizer o (Adam: m, v, plus an fp32
  master copy in mixed precision). Mixed bf16/fp16 (DeepSpeed's layout): w=2, g=2, o=12.
  fp32 (and distlab's autocast, whose weights stay fp32): w=4, g=4, o=8. 16 bytes/param
  either way; ZeRO-1 shards o, ZeRO-2 shards o+g, ZeRO-3/FSDP shards all three.
  LoRA: frozen weights are w bytes each with no gradient or optimizer state.
- Activations per decoder layer: s*b*h*(34 + 5*a*s/h) bytes at 16 bits (Korthikanti et
  al. 2022, "Reducing Activation Recomputation", no recomputation; doubled for fp32), plus
  the logits and their gradient (2*s*b*V fp32). Llama's SwiGLU MLP and SDPA attention make
  this an approximation; the run check below says how far off it was.
"""
from __future__ import annotations

import copy

GIB = 2**30
BYTES_PER_PARAM = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}
ROW_ORDER = ["ddp", "zero1", "zero2", "zero3", "zero3-offopt", "zero3-offopt-offparam"]
ROW_LABEL = {
    "ddp": "DDP (each device holds everything)",
    "zero1": "ZeRO-1 (optimizer state sharded)",
    "zero2": "ZeRO-2 (+ gradients sharded)",
    "zero3": "ZeRO-3 / FSDP full shard (+ parameters sharded)",
    "zero3-offopt": "ZeRO-3 + optimizer offload to CPU",
    "zero3-offopt-offparam": "ZeRO-3 + optimizer and parameter offload to CPU",
}


def unit_for(nbytes: float) -> tuple[str, float]:
    return ("GiB", GIB) if nbytes >= GIB else ("MiB", 2**20)


def human(nbytes: float) -> str:
    unit, scale = unit_for(nbytes)
    return f"{nbytes / scale:.1f} {unit}"


def model_shape(config_json: dict) -> dict:
    """The numbers the estimates need, read through transformers.AutoConfig (so GPT-2's
    n_embd/n_layer, GPT-NeoX's names, tied embeddings all mean what the model means)."""
    from transformers import AutoConfig

    if "model_type" not in config_json:
        raise ValueError("model config.json has no 'model_type': transformers.AutoConfig cannot tell the family")
    try:
        config = AutoConfig.for_model(**config_json)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model config.json: transformers.AutoConfig refuses it ({exc})") from None
    hidden, heads = config.hidden_size, config.num_attention_heads
    intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                    or 4 * hidden)
    return {"model_type": config.model_type, "hidden_size": hidden, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or hidden // heads,
            "intermediate_size": intermediate, "vocab_size": config.vocab_size,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
            "config_json": dict(config_json)}


def parameter_counts(shape: dict, lora: dict | None = None) -> dict:
    """Total, embedding, per-layer and LoRA-trainable counts, exact for every family: the
    model is instantiated on the meta device (no memory) and its parameters summed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distlab.model import decoder_layers

    config = AutoConfig.for_model(**shape["config_json"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight.numel()
    output = model.get_output_embeddings()
    tied = output is None or output.weight is model.get_input_embeddings().weight
    head = 0 if tied else output.weight.numel()
    per_layer = sum(p.numel() for p in decoder_layers(model)[0].parameters())
    trainable = total
    if lora is not None:
        from distlab.lora import apply_lora

        model, _ = apply_lora(model, lora, seed=0)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
    return {"total": total, "embedding": embedding, "per_layer": per_layer,
            "largest_unit": max(per_layer, embedding, head), "trainable": trainable}


def precision_layout(precision: str) -> str:
    return "fp32" if precision == "fp32" else "mixed"


def model_state(key: str, counts: dict, n: int, precision: str, lora: bool) -> dict:
    """Bytes one device holds for weights, gradients and optimizer, plus what sits in CPU RAM."""
    w, g, o = BYTES_PER_PARAM[precision_layout(precision)]
    psi, trainable = counts["total"], counts["trainable"]
    frozen = psi - trainable if lora else 0
    weights = w * psi
    grads, optim = g * trainable, o * trainable
    if lora and precision_layout(precision) == "mixed":
        weights = w * frozen + 4 * trainable  # adapters keep an fp32 copy
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n)}.get(key, (n, n, n))
    out = {"params": weights / shard[0], "grads": grads / shard[1], "optimizer": optim / shard[2],
           "gathered": 0.0, "cpu_offloaded": 0.0}
    if key.startswith("zero3"):
        # Transient, not held: the unit (layer or embedding) all-gathered for compute.
        out["gathered"] = w * counts["largest_unit"]
    if key.startswith("zero3-offopt"):
        out["cpu_offloaded"] += out["optimizer"]
        out["optimizer"] = 0.0
    if key == "zero3-offopt-offparam":
        out["cpu_offloaded"] += out["params"]
        out["params"] = 0.0
    return out


def activation_bytes(shape: dict, micro_batch: int, seq_len: int, precision: str) -> float:
    s, b, h, a = seq_len, micro_batch, shape["hidden_size"], shape["num_attention_heads"]
    per_layer = s * b * h * (34 + 5 * a * s / h)
    if precision == "fp32":
        per_layer *= 2
    logits = 2 * s * b * shape["vocab_size"] * 4
    return shape["num_hidden_layers"] * per_layer + logits


def estimate(shape: dict, workload: dict, n: int) -> list[dict]:
    """One row per strategy: estimated bytes per device for this workload on n devices."""
    lora = workload["method"] == "lora"
    counts = parameter_counts(shape, workload["lora"] if lora else None)
    act = activation_bytes(shape, workload["micro_batch"], workload["seq_len"], workload["precision"])
    rows = []
    for key in ROW_ORDER:
        state = model_state(key, counts, n, workload["precision"], lora)
        device_state = state["params"] + state["grads"] + state["optimizer"] + state["gathered"]
        rows.append({"key": key, "strategy": ROW_LABEL[key], "devices": n, **state,
                     "model_state_bytes": device_state, "activation_bytes": act,
                     "total_bytes": device_state + act})
    return rows


def plan_devices(hardware: dict, advisor_cfg: dict, cpu_ranks: int) -> dict:
    """What to plan for: configured GPUs, else hardware.json's GPUs, else the CPU's RAM."""
    nodes = advisor_cfg.get("nodes", 1)
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
    from distlab.config import EXPERIMENT_DEFAULTS, _deep_merge

    spec = _deep_merge(EXPERIMENT_DEFAULTS, config.get("defaults", {}))
    return {k: copy.deepcopy(spec[k]) for k in ("method", "micro_batch", "seq_len", "precision", "lora")}


def advise(model_config: dict, hardware: dict, config: dict, cpu_ranks: int = 1) -> dict:
    shape = model_shape(model_config)
    workload = workload_from_config(config)
    plan = plan_devices(hardware, config.get("advisor", {}), cpu_ranks)
    budget = plan["smallest_bytes"] * (1 - config.get("advisor", {}).get("headroom", 0.1))
    one = {r["key"]: r for r in estimate(shape, workload, 1)}
    many = {r["key"]: r for r in estimate(shape, workload, plan["devices"])}
    fits = {k: r["total_bytes"] <= budget for k, r in many.items()}
    reasons, n = [], plan["devices"]
    if one["ddp"]["total_bytes"] <= budget:
        pick = "ddp"
        reasons.append(f"the whole training state ({human(one['ddp']['total_bytes'])}) fits one device "
                       f"({human(budget)} usable): plain data parallel (DDP, stage 1-2) needs no sharding")
    elif fits["zero3"]:
        pick = "zero3"
        reasons.append(f"it does not fit one device ({human(one['ddp']['total_bytes'])} > {human(budget)} usable) "
                       f"but sharded over {n} devices it does: ZeRO-3 or FSDP (stages 3-4)")
    elif fits["zero3-offopt"]:
        pick = "zero3-offopt"
        reasons.append("even fully sharded it does not fit; with the optimizer state in CPU RAM it does: "
                       "ZeRO-3 + optimizer offload (or FSDP CPU offload)")
    elif fits["zero3-offopt-offparam"]:
        pick = "zero3-offopt-offparam"
        reasons.append("only with parameters and optimizer state in CPU RAM: ZeRO-3 + full CPU offload "
                       f"(needs ~{many[pick]['cpu_offloaded'] / GIB:.0f} GiB of CPU RAM per device)")
    else:
        pick = None
        reasons.append("nothing fits, even with full CPU offload: more or larger devices, a smaller micro-batch "
                       "or sequence, activation checkpointing, LoRA, or NVMe offload (ZeRO-Infinity)")
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
    return {"schema_version": 1, "model": {"shape": shape, "parameters": parameter_counts(
                shape, workload["lora"] if workload["method"] == "lora" else None)},
            "workload": workload, "devices": plan, "usable_bytes_per_device": budget,
            "recommendation": pick, "recommendation_label": ROW_LABEL.get(pick, "none fits"),
            "reasons": reasons, "estimates": list(many.values()), "single_device": one["ddp"],
            "how": __doc__.split("Memory = ", 1)[1].strip()}


def estimate_key(spec: dict) -> str | None:
    """Which estimate row a run's spec corresponds to (None: no formula for it)."""
    strategy = spec["strategy"]
    if strategy in ("ddp", "accelerate"):
        return "ddp"
    if strategy == "deepspeed":
        ds = spec["deepspeed"]
        stage = ds["zero_stage"]
        if stage < 3:
            return ["ddp", "zero1", "zero2"][stage]
        if ds["offload_param"] != "none":
            return "zero3-offopt-offparam"
        return "zero3-offopt" if ds["offload_optimizer"] != "none" else "zero3"
    if strategy == "fsdp":
        return "zero3-offopt-offparam" if spec["fsdp"]["cpu_offload"] else "zero3"
    return None


def check_against_runs(advice: dict, runs: list[dict], tolerance: float = 0.25) -> list[dict]:
    """The advisor's estimate for each measured run's own spec next to what the run measured."""
    shape = advice["model"]["shape"]
    rows = []
    for run in runs:
        # The advice sizes the base model: a run on a model.extra model is checked by none of its rows.
        if run.get("status") != "ok" or not run.get("memory") or run["spec"].get("model", "default") != "default":
            continue
        spec, key = run["spec"], estimate_key(run["spec"])
        held = (run["memory"].get("model_state_bytes_per_rank") or [None])[0]
        if key is None or not held:
            continue
        workload = {k: spec[k] for k in ("method", "micro_batch", "seq_len", "precision", "lora")}
        est = {r["key"]: r for r in estimate(shape, workload, spec["world_size"])}[key]
        # Measured state counts every tensor the rank holds, wherever it lives (offload included).
        expected = est["params"] + est["grads"] + est["optimizer"] + est["cpu_offloaded"]
        measured = sum(held.get(k, 0) or 0 for k in ("params", "grads", "optimizer", "offloaded_params",
                                                     "offloaded_grads", "offloaded_optimizer"))
        ratio = measured / expected if expected else None
        parts = []
        for part in ("params", "grads", "optimizer"):
            guess = est[part] if "off" not in key else None  # offloaded parts are compared in the total
            if guess and held.get(part) and abs(held[part] / guess - 1) > tolerance:
                parts.append(f"{part}: estimated {guess / 2**20:.1f} MiB, measured {held[part] / 2**20:.1f} MiB")
        row = {"machine": run["machine"], "experiment": run["experiment"], "estimate": key,
               "estimated_state_MiB": round(expected / 2**20, 2), "measured_state_MiB": round(measured / 2**20, 2),
               "measured/estimated": round(ratio, 3) if ratio else None,
               "verdict": "right" if ratio and abs(ratio - 1) <= tolerance else "WRONG",
               "where": "; ".join(parts)}
        peaks = [m.get("cuda_max_allocated_bytes") for m in run["memory"].get("per_rank", [])]
        peaks = [p for p in peaks if p]
        if peaks:
            row["estimated_peak_MiB"] = round(est["total_bytes"] / 2**20, 1)
            row["measured_cuda_peak_MiB"] = round(max(peaks) / 2**20, 1)
        else:
            row["estimated_peak_MiB"] = round(est["total_bytes"] / 2**20, 1)
            row["measured_cuda_peak_MiB"] = None
        rows.append(row)
    return rows


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
              "", f"| strategy | params {unit} | grads {unit} | optimizer {unit} | gathered {unit} | activations {unit} | "
              f"total {unit}/device | CPU RAM {unit}/device | fits |", "|---|---|---|---|---|---|---|---|---|"]
    for row in advice["estimates"]:
        fits = "yes" if row["total_bytes"] <= advice["usable_bytes_per_device"] else "no"
        cells = [row[k] / scale for k in ("params", "grads", "optimizer", "gathered", "activation_bytes",
                                          "total_bytes", "cpu_offloaded")]
        lines.append(f"| {row['strategy']} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {fits} |")
    lines += ["", "How estimated: " + " ".join(advice["how"].split()), ""]
    return "\n".join(lines)

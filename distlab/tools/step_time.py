"""A run's step time predicted from measured parts, before it trains; the report scores it.

    step = compute + exposed communication + optimizer (and offload copies) + pipeline bubble
           (+ the sharding wrapper's hooks and copies, ZeRO-3 and FSDP)

Every input is measured on the machine or read from a cited table, never fitted to runs:
- compute: the step's kernels at the model's own shapes (each decoder-layer matmul forward,
  input-gradient and weight-gradient, attention, the layer's elementwise work, the LM head and
  its loss), each timed by the compute probe (distlab.tools.compute_probe) at the rank's thread
  count and dtype: `kernels_needed` names them, the probe times exactly those (on a GPU too:
  the probe runs its kernels on the device the runs use).
- communication: the bytes each strategy sends per step (`collectives_per_step`), each call
  timed at its message size from collectives.json (this machine's gloo/NCCL benchmark, or the
  capped link's), which includes each call's latency. Exposed: on CPU ranks, all of it unless
  cores are free for the communication thread; on GPUs, DDP's bucketed all-reduce hides
  behind the backward except its last bucket.
- optimizer: AdamW over the parameters each rank steps (timed by the probe), gradient
  clipping's read of the gradients, and offload's host copies (probe's copy bandwidth).
- bubble: (stages - 1) pipeline micro-batch slots of a GPipe/1F1B schedule.
- sharding (ZeRO-3 and FSDP2 runs only): what the wrapper's hooks around every module and its
  parameter bookkeeping cost (the toy-width model's step wrapped as the run wraps it, on one
  rank, minus the same step plain, both timed by the probe: a probe key of its own, `-zero3`,
  `-fsdp`...) plus the copies it makes at full width that a one-rank wrapper skips (the
  gathered parameters' and reduce-scattered gradients' bytes at the probe's copy rate).

Arithmetic on dicts (`model_parts` alone reads a model's shapes, through transformers on the meta
device): the advisor's time ranking of named boxes (advisor_time.py) uses its byte counts too.
"""
from __future__ import annotations

import math

from distlab.records.predictions import TERMS
from distlab.records.spec import Spec
from distlab.tools.step_collectives import GRAD_BYTES, collective_seconds, collectives_per_step, wire_bytes_per_rank


def compute_dtype(spec: Spec) -> str:
    return {"bf16": "bfloat16", "fp16": "float16"}.get(spec.precision, "float32")


# The optimizer's and the copies' rates are measured at one size each and scaled by the
# parameter count: both stream memory (AdamW reads and writes 7 fp32 values a parameter).
RATE_PARAMS = 2**22
RATE_BYTES = 2**24


def probe_key(spec: Spec) -> str:
    """What a rank's kernels depend on, as the compute probe's file name: its device, dtype and
    threads, its micro-batch rows x sequence, the tensor-parallel degree that splits its linears,
    and QLoRA's 4-bit weights. Experiments of one key share one probe; another learning rate or
    strategy of the same shapes needs no new probe."""
    world, strategy = spec.world_size, spec.strategy
    rows = spec.micro_batch // spec.pp["microbatches"] if strategy == "pp" else spec.micro_batch
    threads = spec.cpu_threads_per_rank if spec.device == "cpu" else 0
    wrapper = sharding_wrapper(spec)
    return (f"{spec.device}-{compute_dtype(spec)}-t{threads}-r{rows}x{spec.seq_len}"
            f"-tp{world if strategy == 'tp' else 1}" + ("-nf4" if spec.method == "qlora" else "")
            + (f"-{wrapper}" if wrapper else ""))


# The sharding wrappers whose per-module hooks and copies the compute probe times (a probe key's
# suffix): DeepSpeed ZeRO-3 by zero3_profile, FSDP2 full shard (resharding after forward) or not.
WRAPPERS = ("zero3", "zero3lean", "fsdp", "fsdpkeep")


def sharding_wrapper(spec: Spec) -> str | None:
    """The wrapper a run's parameters are sharded by, gathered around every module's forward
    and backward (None: DDP, ZeRO 0-2, TP, PP, whose modules run unwrapped). CPU runs only: on
    a GPU the wrapper's host work can hide behind the kernels, which no probe here has measured,
    and the GPU kit's plan has no time for a probe per wrapper (tests/test_gpu_check.py)."""
    if spec.device != "cpu":
        return None
    if spec.strategy == "deepspeed" and spec.deepspeed["zero_stage"] == 3:
        return "zero3lean" if spec.deepspeed.get("zero3_profile") == "lean" else "zero3"
    if spec.strategy == "fsdp":
        return "fsdp" if spec.fsdp["reshard_after_forward"] else "fsdpkeep"
    return None


def parse_probe_key(key: str) -> dict:
    import re

    found = re.fullmatch(r"(cpu|cuda)-(\w+)-t(\d+)-r(\d+)x(\d+)-tp(\d+)(-nf4)?(?:-(" + "|".join(WRAPPERS) + "))?",
                         key)
    if not found:
        raise ValueError(f"not a compute probe key: {key!r}")
    device, dtype, threads, rows, seq, tp, nf4, wrapper = found.groups()
    return {"device": device, "dtype": dtype, "threads": int(threads), "rows": int(rows), "seq": int(seq),
            "tp": int(tp), "nf4": bool(nf4), "wrapper": wrapper}


def _key(kind: str, *dims) -> str:
    return kind + ":" + "x".join(str(int(d)) for d in dims)


def _layout(key: dict, shape: dict, counts: dict) -> dict:
    """What one rank computes per micro-step at a probe key: tokens and its linears' shapes."""
    tp = key["tp"]
    linears = []
    for name, fan_in, fan_out, split in counts["_linears"]:
        if name == "lm_head":
            continue
        if tp > 1 and split == 0:
            fan_out = math.ceil(fan_out / tp)
        elif tp > 1 and split == 1:
            fan_in = math.ceil(fan_in / tp)
        linears.append((fan_in, fan_out))
    head = next((i, o) for name, i, o, _ in counts["_linears"] if name == "lm_head")
    return {**key, "tokens": key["rows"] * key["seq"], "linears": linears, "head": head,
            "heads": math.ceil(shape["num_attention_heads"] / tp), "head_dim": shape["head_dim"],
            "hidden": shape["hidden_size"], "intermediate": math.ceil(shape["intermediate_size"] / tp),
            "vocab": shape["vocab_size"]}


def trainable_per_rank(spec: Spec, counts: dict) -> float:
    """Parameters each rank's optimizer steps."""
    world, strategy = spec.world_size, spec.strategy
    sharded = strategy == "fsdp" or (strategy == "deepspeed" and spec.deepspeed["zero_stage"] >= 1)
    split = strategy in ("tp", "pp")
    return counts["trainable"] / world if (sharded or split) else counts["trainable"]


def model_parts(spec: Spec, config_json: dict) -> tuple[dict, dict, int]:
    """(shape, parameter counts with the run's adapters, layers whose forward runs twice under
    activation checkpointing on one rank) of a spec's model, from its config.json."""
    from distlab.runtime.activations import checkpointed_layers
    from distlab.runtime.parameter_counts import model_shape, workload_counts

    shape = model_shape(config_json)
    counts = workload_counts(shape, {"method": spec.method, "lora": spec.lora})
    held = math.ceil(counts["layers"] / (spec.world_size if spec.strategy == "pp" else 1))
    mode = spec.activation_checkpointing
    ac_layers = 0 if mode == "none" else len(checkpointed_layers(mode, spec.activation_checkpointing_every, held))
    return shape, counts, ac_layers


def kernels_needed(key: str, shape: dict, counts: dict) -> list[dict]:
    """The kernels the probe times for a probe key: {key, kind, dims, dtype, threads}."""
    lay = _layout(parse_probe_key(key), shape, counts)
    t, dtype, threads = lay["tokens"], lay["dtype"], lay["threads"]
    out = []

    def add(kind, *dims, dt=dtype):
        out.append({"key": _key(kind, *dims), "kind": kind, "dims": list(dims), "dtype": dt, "threads": threads})

    for fan_in, fan_out in lay["linears"] + [lay["head"]]:
        add("mm", t, fan_in, fan_out)     # forward: [T, in] @ [in, out]
        add("mm", t, fan_out, fan_in)     # input gradient: [T, out] @ [out, in]
        add("mm", fan_out, t, fan_in)     # weight gradient: [out, T] @ [T, in]
    if lay["nf4"]:  # each 4-bit weight is dequantised for its forward and again for backward
        for fan_in, fan_out in lay["linears"]:
            add("dequant_nf4", fan_out, fan_in)
    add("sdpa", lay["rows"], lay["heads"], lay["seq"], lay["head_dim"])
    add("elementwise", t, lay["hidden"], lay["intermediate"])
    add("cross_entropy", t, lay["vocab"])
    add("framework", lay["rows"], lay["seq"])
    if lay["wrapper"]:  # the same toy step wrapped as the run wraps it (sharding_term)
        add(f"wrapped-{lay['wrapper']}", lay["rows"], lay["seq"])
    add("adamw", RATE_PARAMS, dt="float32")
    add("copy", RATE_BYTES, dt="uint8")
    return out


def _time(probe: dict, kind: str, *dims, dtype: str, threads: int, part: str = "s", neighbours: float = 1.0) -> float:
    row = probe["kernels"].get(f"{_key(kind, *dims)}|{dtype}|{threads}")
    if row is None:
        raise KeyError(f"compute probe has no {kind} {dims} in {dtype} at {threads} thread(s)")
    return _beside(row, part, neighbours)


def _beside(row: dict, part: str, neighbours: float) -> float:
    """A kernel's time when a `neighbours` share of the other cores is busy: between its time
    alone and beside copies of itself on every other core (where the probe had other cores)."""
    alone = row.get({"s": "alone_s", "forward_s": "forward_alone_s"}[part])
    return row[part] if alone is None else alone + neighbours * (row[part] - alone)


def neighbour_share(spec: Spec, usable_cores: int, others_cores: float | None) -> float:
    """The share of the cores a run leaves free that others keep busy: 1 where its ranks fill the
    machine (the other ranks are the neighbours) or nothing was measured; otherwise what other
    processes used, measured by rank 0 from its start to the prediction (distlab.rank.worker)."""
    free = usable_cores - spec.world_size * max(1, spec.cpu_threads_per_rank)
    if spec.device != "cpu" or free <= 0 or others_cores is None:
        return 1.0
    return min(1.0, max(0.0, others_cores / free))


def compute_term(spec: Spec, shape: dict, counts: dict, probe: dict, ac_layers: int = 0,
                 neighbours: float = 1.0) -> dict:
    """Seconds of one rank's kernels per step (all micro-batches; a pipeline rank's own
    micro-batch slots, without the bubble), with a `neighbours` share of the other cores busy
    (neighbour_share)."""
    lay = _layout(parse_probe_key(probe_key(spec)), shape, counts)
    t, dt, th = lay["tokens"], lay["dtype"], lay["threads"]
    frozen_base = spec.method in ("lora", "qlora")
    stages = spec.world_size if spec.strategy == "pp" else 1
    pp_micro = spec.pp["microbatches"] if spec.strategy == "pp" else 1
    layers = math.ceil(counts["layers"] / stages)
    layer_fwd = layer_bwd = 0.0

    def at(kind, *dims):
        return _time(probe, kind, *dims, dtype=dt, threads=th, neighbours=neighbours)

    for fan_in, fan_out in lay["linears"]:
        layer_fwd += at("mm", t, fan_in, fan_out)
        layer_bwd += at("mm", t, fan_out, fan_in)
        if not frozen_base:  # a frozen weight gets no weight-gradient matmul
            layer_bwd += at("mm", fan_out, t, fan_in)
        if lay["nf4"]:
            dequant = at("dequant_nf4", fan_out, fan_in)
            layer_fwd += dequant
            layer_bwd += dequant
    attn = probe["kernels"][f"{_key('sdpa', lay['rows'], lay['heads'], lay['seq'], lay['head_dim'])}|{dt}|{th}"]
    elem = probe["kernels"][f"{_key('elementwise', t, lay['hidden'], lay['intermediate'])}|{dt}|{th}"]
    fwd = {name: _beside(row, "forward_s", neighbours) for name, row in (("attn", attn), ("elem", elem))}
    layer_fwd += fwd["attn"] + fwd["elem"]
    layer_bwd += (_beside(attn, "s", neighbours) - fwd["attn"]) + (_beside(elem, "s", neighbours) - fwd["elem"])
    hi, ho = lay["head"]
    head = (at("mm", t, hi, ho) + at("mm", t, ho, hi)
            + (0.0 if frozen_base else at("mm", ho, t, hi))
            + at("cross_entropy", t, lay["vocab"]))
    # What the op graph costs beyond its kernels (dispatch, autograd, small ops), from the toy-width
    # model; a pipeline stage runs its share of the layers.
    framework = at("framework", lay["rows"], lay["seq"]) * layers / counts["layers"]
    # A pipeline's last stage alone runs the head; the step waits for it.
    per_micro = layers * (layer_fwd + layer_bwd) + ac_layers * layer_fwd + head + framework
    micro_steps = spec.grad_accum * pp_micro
    return {"seconds": per_micro * micro_steps,
            "parts": {"layers": layers * (layer_fwd + layer_bwd) * micro_steps,
                      "recompute": ac_layers * layer_fwd * micro_steps, "head_and_loss": head * micro_steps,
                      "framework": framework * micro_steps},
            "how": (f"{micro_steps} micro-step(s) x ({layers} layer(s) x (matmuls forward, input-gradient"
                    f"{'' if frozen_base else ', weight-gradient'}"
                    f"{', 4-bit dequantisation' if spec.method == 'qlora' else ''} + attention + "
                    f"elementwise) + LM head and loss + the op graph's own cost (the model at toy width)"
                    f"{f' + {ac_layers} recomputed layer forward(s)' if ac_layers else ''}) at {t} tokens, {dt}, "
                    f"{th or 'GPU'} thread(s): each kernel timed by the compute probe"
                    + ("" if neighbours == 1 else f", {neighbours:.0%} of the way from its time alone to its time "
                       "beside copies of itself on the other cores (the share of the free cores others kept busy "
                       "as the run started)"))}


def communication_term(spec: Spec, shape: dict, counts: dict, collectives: dict | None, compute: dict,
                       free_cores: float) -> dict:
    calls = collectives_per_step(spec, shape, counts)
    if not calls:
        return {"seconds": 0.0, "total_s": 0.0, "bytes": 0, "calls": [], "how": "one rank: no collectives"}
    if collectives is None:
        raise ValueError("a multi-rank prediction needs the machine's collectives.json")
    world = spec.world_size
    total = 0.0
    rows = []
    for c in calls:
        seconds = c["calls"] * collective_seconds(collectives, c["op"], c["bytes"], world, spec.device)
        rows.append({**c, "seconds": seconds})
        total += seconds
    exposed, overlap_how = total, "not overlapped"
    on_gpu = spec.device == "cuda"
    if spec.strategy in ("ddp", "accelerate") and (on_gpu or free_cores >= 1):
        last = rows[-1]["seconds"]
        backward = compute["parts"]["layers"] * 2 / 3  # the backward holds ~2/3 of the layers' kernels
        exposed = max(last, total - backward)
        overlap_how = "DDP's buckets overlap the backward; the last bucket is exposed"
    elif not on_gpu:
        overlap_how = ("not overlapped: every core computes for a rank, so the collectives' thread takes "
                       "turns with the computation")
    return {"seconds": exposed, "total_s": total, "bytes": sum(c["bytes"] * c["calls"] for c in calls),
            "wire_bytes_per_rank": wire_bytes_per_rank(calls, world, spec.device),
            "calls": rows,
            "how": f"each call at its message size from {collectives.get('_file', 'collectives.json')} (median "
                   "time, latency included; log-interpolated between measured sizes, past the largest at its "
                   f"bandwidth); {overlap_how}"}


def optimizer_term(spec: Spec, counts: dict, probe: dict, neighbours: float = 1.0) -> dict:
    n = max(1, round(trainable_per_rank(spec, counts)))
    threads = spec.cpu_threads_per_rank if spec.device == "cpu" else 0
    rate = {kind: _time(probe, kind, size, dtype=dtype, threads=threads, neighbours=neighbours)
            for kind, size, dtype in (("adamw", RATE_PARAMS, "float32"), ("copy", RATE_BYTES, "uint8"))}
    adamw = rate["adamw"] * n / RATE_PARAMS
    copy = rate["copy"] * n * GRAD_BYTES / RATE_BYTES
    clip = copy if spec.max_grad_norm else 0.0
    ds = spec.deepspeed or {}
    offload = 0.0
    copies = 0
    if spec.strategy == "deepspeed" and ds.get("offload_optimizer") in ("cpu", "nvme"):
        copies += 2  # gradients to the host, updated parameters back
    if spec.strategy == "deepspeed" and ds.get("offload_param") in ("cpu", "nvme"):
        copies += 2 * spec.grad_accum  # each micro-batch's forward and backward fetch the partition
    if spec.strategy == "fsdp" and (spec.fsdp or {}).get("cpu_offload"):
        copies += 2 + 2 * spec.grad_accum
    offload = copies * copy
    return {"seconds": adamw + clip + offload, "parts": {"adamw": adamw, "clip": clip, "offload_copies": offload},
            "how": f"AdamW over {n} parameters and copies of their {GRAD_BYTES * n} gradient bytes, at the rates "
                   f"the probe measured ({RATE_PARAMS} parameters, {RATE_BYTES} "
                   f"bytes){' + gradient-norm read' if clip else ''}"
                   f"{f' + {copies} host copies of the partition' if copies else ''}"}


def sharding_term(spec: Spec, shape: dict, counts: dict, probe: dict, neighbours: float = 1.0) -> dict | None:
    """What a sharding wrapper (ZeRO-3, FSDP2) adds to the step on the rank's own cores, None for
    a run without one: its fixed cost per micro-step (hooks around every module's forward and
    backward, parameter bookkeeping, gradient hooks) = the toy-width model wrapped as the run
    wraps it minus the same model plain, both timed by the compute probe on one rank; plus the
    bytes it copies at full width, which a one-rank wrapper skips (DeepSpeed and FSDP2 gather
    nothing at world size 1): each all-gathered parameter byte and each reduce-scattered
    gradient byte of the step (collectives_per_step, the communication term's count) copied once,
    between the tensors and the collective's flat buffer, at the probe's copy rate."""
    wrapper = sharding_wrapper(spec)
    if wrapper is None:
        return None
    lay = parse_probe_key(probe_key(spec))
    th = lay["threads"]

    def at(kind, *dims, dtype=lay["dtype"]):
        return _time(probe, kind, *dims, dtype=dtype, threads=th, neighbours=neighbours)

    wrapped, plain = at(f"wrapped-{wrapper}", lay["rows"], lay["seq"]), at("framework", lay["rows"], lay["seq"])
    fixed = max(0.0, wrapped - plain) * spec.grad_accum
    copied = sum(c["bytes"] * c["calls"] for c in collectives_per_step(spec, shape, counts)
                 if c["op"] in ("all_gather", "reduce_scatter"))
    copies = at("copy", RATE_BYTES, dtype="uint8") * copied / RATE_BYTES
    return {"seconds": fixed + copies, "parts": {"hooks": fixed, "copies": copies},
            "how": f"{spec.grad_accum} micro-step(s) x (the toy-width model's step wrapped by {wrapper} on one rank "
                   f"{wrapped:.4f} s - the same step plain {plain:.4f} s, both timed by the compute probe) + "
                   f"{copied:.0f} gathered-parameter and reduce-scattered gradient bytes (the communication "
                   f"term's collectives) copied once at the probe's copy rate ({RATE_BYTES} bytes)"}


def bubble_term(spec: Spec, compute: dict) -> dict:
    if spec.strategy != "pp":
        return {"seconds": 0.0, "how": "no pipeline"}
    m, p = spec.pp["microbatches"], spec.world_size
    slot = compute["seconds"] / (m * spec.grad_accum)
    return {"seconds": (p - 1) * slot * spec.grad_accum,
            "how": f"{spec.pp['schedule']}: (stages - 1) = {p - 1} idle micro-batch slot(s) of {slot:.4f} s"}


def predict(spec: Spec, shape: dict, counts: dict, probe: dict, collectives: dict | None,
            usable_cores: int, ac_layers: int = 0, others_cores: float | None = None) -> dict:
    """metrics.json's `prediction`: the step time and its terms (records.predictions.TERMS), each
    with how. others_cores: the cores other processes kept busy as the run started (None: not
    measured)."""
    neighbours = neighbour_share(spec, usable_cores, others_cores)
    compute = compute_term(spec, shape, counts, probe, ac_layers, neighbours)
    busy_cores = spec.world_size * max(1, spec.cpu_threads_per_rank)
    comm = communication_term(spec, shape, counts, collectives, compute, usable_cores - busy_cores)
    optim = optimizer_term(spec, counts, probe, neighbours)
    bubble = bubble_term(spec, compute)
    sharding = sharding_term(spec, shape, counts, probe, neighbours)  # None: no sharding wrapper
    found = {"compute": compute, "communication": comm, "sharding": sharding, "optimizer": optim, "bubble": bubble}
    terms = {name: found[name] for name in TERMS if found[name] is not None}  # the report's order
    step = sum(t["seconds"] for t in terms.values())
    return {"status": "predicted", "step_time_s": step, "terms": terms,
            "how": "compute + exposed communication + optimizer and offload + pipeline bubble"
                   f"{' + the sharding wrapper' if sharding else ''}, from the compute probe and collectives.json "
                   "measured on this machine before the run (distlab.tools.step_time)"}


def predict_from_files(spec: Spec, model_config: str, probe_file: str | None, collectives_file: str | None,
                       hardware_file: str, others_cores: float | None = None) -> dict:
    """The prediction rank 0 records before the first step (distlab.rank.worker), or why there
    is none. others_cores: the cores other processes kept busy as the run started."""
    import json
    from pathlib import Path

    if probe_file is None or model_config is None:
        return {"status": "not predicted", "why": "no compute probe for this run: the step-time model covers "
                                                 "causal-LM runs of the train rule on a model whose config.json is "
                                                 "on disk"}
    unequal = [k for k in ("rank_cpu_budget", "rank_cpu_threads", "rank_micro_batch") if spec.get(k)]
    if unequal:
        return {"status": "not predicted", "why": f"ranks of unequal speed or batch ({', '.join(unequal)}): the model "
                                                 "times one rank's kernels for every rank"}
    if spec.world_size > 1 and collectives_file is None:
        return {"status": "not predicted", "why": "no collectives.json (collectives.enabled is false)"}
    shape, counts, ac_layers = model_parts(spec, json.loads(Path(model_config).read_text()))
    probe = json.loads(Path(probe_file).read_text())
    collectives = json.loads(Path(collectives_file).read_text()) if collectives_file else None
    if collectives is not None:
        collectives["_file"] = Path(collectives_file).name
    hardware = json.loads(Path(hardware_file).read_text())
    try:
        found = predict(spec, shape, counts, probe, collectives, hardware["cpu"]["usable_cores"], ac_layers,
                        others_cores)
    except KeyError as missing:  # a kernel or collective the files lack: said, not guessed
        return {"status": "not predicted", "why": str(missing).strip("'\"")}
    probe_noise = probe.get("noise") or {}  # absent from a probe of an older distlab
    return {**found, "inputs": {"probe": Path(probe_file).name, "collectives": collectives and collectives["_file"],
                                "hardware": Path(hardware_file).name, "others_cores_at_start": others_cores,
                                "probe_busy": probe_noise.get("busy"),
                                "probe_others_cores": probe_noise.get("others_cores")}}


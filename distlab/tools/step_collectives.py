"""What each strategy sends per optimizer step and how long each call takes, for the step-time
model (distlab.tools.step_time) and the advisor's time ranking of named boxes
(distlab.tools.advisor_time): the collectives one rank issues (as counted in profiled steps:
tests/test_step_time_bytes.py), the bytes they put on the wire, and each call's time at its size
from a collectives.json.
"""
from __future__ import annotations

import math

from distlab.records.spec import Spec

# DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, the
# first bucket 1 MiB: dist._DEFAULT_FIRST_BUCKET_BYTES).
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
GRAD_BYTES = 4  # fp32 gradients and optimizer state (DeepSpeed's 16-bit gradients: collectives_per_step)


def collectives_per_step(spec: Spec, shape: dict, counts: dict) -> list[dict]:
    """The collectives one rank issues per optimizer step: {op, bytes, calls, phase}."""
    world, strategy = spec.world_size, spec.strategy
    if world == 1:
        return []
    ga = spec.grad_accum
    # DeepSpeed and FSDP2 hold (and gather) parameters in the 16-bit type of a mixed-precision run;
    # DeepSpeed reduces its gradients in it too, FSDP2 in fp32 (reduce_dtype), DDP in fp32.
    sixteen = spec.precision in ("bf16", "fp16") and strategy in ("deepspeed", "fsdp")
    element = 2 if sixteen else GRAD_BYTES
    grads = counts["trainable"] * (element if strategy == "deepspeed" else GRAD_BYTES)
    params = counts["trainable"] * element  # ZeRO-1/2 gather the updated (trained) partitions
    if strategy in ("ddp", "accelerate"):
        buckets = _buckets(grads)
        return [{"op": "all_reduce", "bytes": b, "calls": 1, "phase": "backward (gradient buckets)"} for b in buckets]
    if strategy == "deepspeed":
        stage = spec.deepspeed["zero_stage"]
        if stage == 0:
            return [{"op": "all_reduce", "bytes": grads, "calls": 1, "phase": "gradients"}]
        buckets = math.ceil(counts["trainable"] / _zero_bucket(counts))
        if stage in (1, 2):
            # As counted in profiled steps over gloo: stage 1 all-reduces the gradients once at the
            # step's boundary, stage 2 (which keeps only its partition) every micro-batch; both then
            # gather the updated partitions.
            return [{"op": "all_reduce", "bytes": grads / buckets, "calls": buckets * (ga if stage == 2 else 1),
                     "phase": "gradients"},
                    {"op": "all_gather", "bytes": params, "calls": 1, "phase": "updated parameters"}]
        forward, backward = _zero3_gathers(spec, counts)
        gathered = forward + backward
        return [{"op": "all_gather", "bytes": sum(gathered) * element / max(1, len(gathered)),
                 "calls": len(gathered) * ga,
                 "phase": f"parameters, one collective each: {len(forward)} in forward, {len(backward)} again in "
                          "backward"},
                {"op": "reduce_scatter", "bytes": grads / buckets, "calls": buckets * ga, "phase": "gradients"}]
    if strategy == "fsdp":
        units = counts["layers"] + 1  # fully_shard per decoder layer, then the root
        per_unit = counts["total"] * element / units  # a LoRA run's frozen base is sharded and gathered too
        gathers = (2 if spec.fsdp["reshard_after_forward"] else 1) * units * ga
        # Accumulating micro-batches skip the gradient sync (set_requires_gradient_sync): one
        # reduce-scatter per unit and step.
        return [{"op": "all_gather", "bytes": per_unit, "calls": gathers, "phase": "parameters"},
                {"op": "reduce_scatter", "bytes": grads / units, "calls": units, "phase": "gradients"}]
    if strategy == "tp":
        activation = spec.micro_batch * spec.seq_len * shape["hidden_size"] * 4
        # Each row-parallel linear's output all-reduced in forward, each column-parallel linear's
        # input gradient in backward (DTensor reduces them one by one: counted in a profiled step).
        split = [x[3] for x in counts["_linears"] if x[0] != "lm_head"]
        per_layer = sum(1 for d in split if d is not None)
        return [{"op": "all_reduce", "bytes": activation, "calls": per_layer * counts["layers"] * ga,
                 "phase": "activations"}]
    if strategy == "pp":
        m = spec.pp["microbatches"]
        activation = spec.micro_batch // m * spec.seq_len * shape["hidden_size"] * 4
        # Per stage boundary and pipeline micro-batch, one send forward and one backward.
        return [{"op": "p2p", "bytes": activation, "calls": 2 * m * ga * (world - 1), "phase": "activations"}]
    raise ValueError(f"no communication model for strategy {strategy!r}")


def _zero_bucket(counts: dict) -> int:
    """ZeRO's gradient bucket in elements, as the DeepSpeed config distlab writes sets it."""
    from distlab.strategies.deepspeed_config import gradient_bucket_size

    largest = max((math.prod(shape) for shape, grad in counts["_shapes"] if grad), default=1)
    return gradient_bucket_size(counts["per_layer"], largest, counts["trainable"])


def _zero3_gathers(spec: Spec, counts: dict) -> tuple[list[int], list[int]]:
    """(elements of each parameter ZeRO-3 all-gathers in one micro-batch's forward, and again in
    its backward), from the zero3_profile's settings (distlab.strategies.deepspeed_config) and the
    experiment's own zero_config. A parameter at or under the persistence threshold stays whole on
    every rank; each gathered parameter is one collective (as counted in a profiled step). Backward
    walks the forward in reverse: the parameters used last in forward are still live while they fit
    max_live_parameters and max_reuse_distance, the rest are gathered again; all are released
    after each micro-batch."""
    from distlab.configuration.strategies.deepspeed_settings import zero3_limits

    ds = spec.deepspeed
    limits = {**zero3_limits(ds.get("zero3_profile", "auto"), counts["per_layer"], counts.get("hidden_size")),
              **(ds.get("zero_config") or {})}
    threshold = limits.get("stage3_param_persistence_threshold", 100_000)  # DeepSpeed's default
    forward = [math.prod(shape) for shape, _ in counts["_shapes"] if math.prod(shape) > threshold]
    live = min(limits.get("stage3_max_live_parameters", 1_000_000_000),
               limits.get("stage3_max_reuse_distance", 1_000_000_000))
    kept, still_live = 0, 0
    for numel in reversed(forward):  # parameters() lists them in forward order: embedding ... head
        if still_live + numel > live:
            break
        still_live += numel
        kept += 1
    return forward, forward[:len(forward) - kept]


def wire_bytes_per_rank(calls: list[dict], world: int, device: str = "cuda") -> float:
    """Bytes each rank sends for these calls with ring algorithms: nccl-tests' bus-bandwidth
    factor of the op times its size (an all-reduce of B bytes sends 2(n-1)/n B per rank; an
    all-gather or reduce-scatter (n-1)/n B), and on CPU ranks gloo's reduce-scatter as the
    all-reduce it is (_wire_factor)."""
    return sum(c["bytes"] * c["calls"] * _wire_factor(c["op"], world, device) for c in calls)


def _wire_factor(op: str, world: int, device: str = "cuda") -> float:
    if op == "p2p":  # each message is sent by one of the two ranks of its boundary
        return 0.5
    # gloo (CPU tensors) reduce-scatters by all-reducing the whole input and keeping its chunk: a
    # profiled ZeRO-3 step's reduce_scatter_base calls ran as gloo:all_reduce, over 100 Mbit/s a
    # 4 MiB reduce-scatter took an all-reduce's time (0.356 s each, links/collectives-100m.json),
    # and each FSDP host's eth0 counted 45 MB a step against 31.6 MB with a ring reduce-scatter.
    if op == "all_reduce" or (op == "reduce_scatter" and device == "cpu"):
        return 2 * (world - 1) / world
    return (world - 1) / world


def _buckets(grads: int) -> list[int]:
    out, left = [], grads
    first = min(DDP_FIRST_BUCKET_BYTES, left)
    out.append(first)
    left -= first
    while left > 0:
        out.append(min(DDP_BUCKET_BYTES, left))
        left -= out[-1]
    return out


def collective_seconds(collectives: dict, op: str, size: float, world: int, device: str = "cpu") -> float:
    """Seconds of one `op` of `size` bytes from a collectives.json, on the backend of the ranks'
    `device` (gloo for CPU tensors, NCCL for CUDA ones): log-interpolated between the measured
    sizes, beyond them at the largest size's bus bandwidth, scaled to `world` through nccl-tests'
    bus-bandwidth factor (gloo's reduce-scatter: an all-reduce's, _wire_factor)."""
    if op == "p2p":  # b bytes one way take what an all-gather of 2b takes over two ranks (b each way)
        return collective_seconds(collectives, "all_gather", 2 * size, 2, device)
    backend = "nccl" if device == "cuda" else "gloo"
    rows = sorted(((r["size_bytes"], r) for r in collectives["results"]
                   if r["op"] == op and r.get("status") == "ok" and r.get("backend", backend) == backend),
                  key=lambda row: row[0])
    if not rows:
        raise KeyError(f"collectives.json has no measured {backend} {op}")
    measured_world = collectives["world_size"]
    scale = _wire_factor(op, world, device) / _wire_factor(op, measured_world, device)
    sizes = [s for s, _ in rows]
    if size <= sizes[0]:
        return rows[0][1]["time_s_median"] * scale
    if size >= sizes[-1]:
        top = rows[-1][1]
        return top["time_s_median"] * size / top["size_bytes"] * scale
    for (s0, r0), (s1, r1) in zip(rows, rows[1:]):
        if s0 <= size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return math.exp((1 - w) * math.log(r0["time_s_median"]) + w * math.log(r1["time_s_median"])) * scale
    raise AssertionError("unreachable")

"""DeepSpeed ZeRO's settings (the spec's `deepspeed:` block): defaults, refusals, id part,
checkpoint format and memory formula. The JSON config built from them is deepspeed_config.py."""
from __future__ import annotations

import math

from distlab.configuration.strategies.settings import (StrategySettings, block_schema, precision_layout,
                                                       sharded_counts, state)

OFFLOAD_TARGETS = ["none", "cpu", "nvme"]


# DeepSpeed's own defaults for the live-parameter limits (elements), written out so the file
# says what runs.
DEEPSPEED_LIVE = 1_000_000_000


def zero3_limits(profile: str, layer_params: int | None, hidden_size: int | None) -> dict:
    """ZeRO-3's gathered-parameter settings for a zero3_profile (config/schema.yaml).

    auto: what DeepSpeed users get through Hugging Face's "auto" values
    (transformers.integrations.deepspeed: prefetch 0.9*h^2, persistence threshold 10*h, with h
    the model's hidden size) and the 1e9 live parameters / reuse distance of DeepSpeed's and
    Hugging Face's example configs. Parameters up to 10*h elements (norms, LoRA adapters) stay
    whole on every rank, so they are never all-gathered; a model under 1e9 parameters stays
    gathered from its forward to its backward, so backward re-gathers nothing. Fewest
    collectives, at up to a whole model's gathered copy per rank.

    lean: nothing persistent, one decoder layer live and the next prefetched, as FSDP2's full
    shard holds them: least memory (0.8x a DDP rank's training peak against 1.6-1.9x at the 1e9
    limits on a 155M LoRA model, benchmarks/RESULTS.md), every parameter re-gathered for backward and each
    small one in a collective of its own: on a busy 2-core machine the collectives' waits
    dominate (benchmarks/strategy_parity.py sets the two beside FSDP and DDP).

    layer_params: one decoder layer's parameters (wrap() counts them; None at zero.Init, where
    only the persistence threshold is read)."""
    if profile == "lean":
        out = {"stage3_param_persistence_threshold": 0}
        if layer_params:
            out.update(stage3_max_live_parameters=layer_params, stage3_max_reuse_distance=layer_params,
                       stage3_prefetch_bucket_size=layer_params)
        return out
    if profile != "auto":
        raise ValueError(f"deepspeed.zero3_profile {profile!r}: expected auto or lean")
    out = {"stage3_max_live_parameters": DEEPSPEED_LIVE, "stage3_max_reuse_distance": DEEPSPEED_LIVE}
    if hidden_size:
        out.update(stage3_param_persistence_threshold=10 * hidden_size,
                   stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size))
    return out


def zero3_settings(settings: dict, counts: dict) -> dict:
    """The persistence threshold and live limit a ZeRO-3 run of these settings gets: its
    zero3_profile sized from the model (zero3_limits), zero_config
    over it, DeepSpeed's defaults for what neither sets."""
    out = {"stage3_param_persistence_threshold": 100_000, "stage3_max_live_parameters": 1_000_000_000}
    out.update(zero3_limits(settings.get("zero3_profile", "auto"), counts.get("per_layer"), counts.get("hidden_size")))
    out.update({k: v for k, v in (settings.get("zero_config") or {}).items() if k in out})
    return out


class DeepSpeedSettings(StrategySettings):
    name = "deepspeed"
    rank_libraries = ("deepspeed",)
    defaults = {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none", "nvme_path": None,
                "optimizer_impl": "torch", "zero3_profile": "auto"}
    schema = block_schema({
        "zero_stage": {"description": "ZeRO stage.", "type": "integer", "minimum": 0, "maximum": 3},
        "offload_optimizer": {"description": "Optimizer state offload (stage 1-3).", "enum": OFFLOAD_TARGETS},
        "offload_param": {"description": "Parameter offload (stage 3).", "enum": OFFLOAD_TARGETS},
        "nvme_path": {"description": "Folder for NVMe offload.", "type": ["string", "null"]},
        "zero_config": {
            "description": "Further keys of the generated config's zero_optimization block, over distlab's own "
                           "(e.g. reduce_bucket_size, stage3_max_live_parameters, stage3_prefetch_bucket_size, "
                           "stage3_max_reuse_distance), over the zero3_profile's and the gradient bucket distlab "
                           "sizes from the model; the other keys are DeepSpeed's defaults. Not part of the "
                           "experiment id. The stage-3 budget pair in config/config.yaml bounds ZeRO-3's gathered "
                           "parameters and gradient buckets with it.",
            "type": "object",
            "propertyNames": {"pattern": "^[a-z0-9_]+$",
                              "not": {"enum": ["stage", "offload_optimizer", "offload_param"]}},
            "additionalProperties": {"type": ["number", "boolean", "string"]}},
        "zero3_profile": {
            "description": "ZeRO-3's gathered-parameter settings (distlab.strategies.deepspeed_config.zero3_limits). "
                           "auto: what a DeepSpeed user gets from Hugging Face's \"auto\" values, sized from the "
                           "model's hidden size h: parameters up to 10*h elements stay whole on every rank "
                           "(stage3_param_persistence_threshold), 0.9*h^2 elements prefetched, DeepSpeed's 1e9 live "
                           "parameters and reuse distance (a small model stays gathered from forward to backward: "
                           "fewer collectives, more memory). lean: nothing persistent, one decoder layer live and "
                           "one prefetched (least memory, every parameter re-gathered for backward). zero_config "
                           "overrides either. Stage 3 only; lean adds \"lean\" to the id.",
            "enum": ["auto", "lean"]},
        "optimizer_impl": {
            "description": "torch: torch.optim.AdamW inside DeepSpeed (DeepSpeed's torch_adam; the implementation DDP "
                           "runs, nothing to compile). deepspeed: DeepSpeed's FusedAdam, or DeepSpeedCPUAdam when "
                           "offloading (C++/CUDA ops JIT-built on first use; minutes on a small CPU).",
            "enum": ["torch", "deepspeed"]},
    })
    ray_train = True
    advisor_rows = {"zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3},
                    "zero3-offopt": {"zero_stage": 3, "offload_optimizer": "cpu"},
                    "zero3-offopt-offparam": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}}

    def variant(self, spec):
        ds = spec.deepspeed
        parts = [f"z{ds['zero_stage']}"]
        if ds["offload_optimizer"] != "none":
            parts.append(f"offopt{'' if ds['offload_optimizer'] == 'cpu' else '.nvme'}")
        if ds["offload_param"] != "none":
            parts.append(f"offparam{'' if ds['offload_param'] == 'cpu' else '.nvme'}")
        if ds["optimizer_impl"] == "deepspeed":
            parts.append("dsadam")
        if ds["zero3_profile"] == "lean":
            parts.append("lean")
        return "-".join(parts)

    def check(self, spec, config, fail, shape):
        ds = spec.deepspeed
        if ds["offload_param"] != "none" and ds["zero_stage"] != 3:
            fail("deepspeed.offload_param", "parameter offload needs zero_stage 3")
        if ds["offload_optimizer"] != "none" and ds["zero_stage"] == 0:
            fail("deepspeed.offload_optimizer", "optimizer offload needs zero_stage 1, 2 or 3")
        if ds["zero3_profile"] != "auto" and ds["zero_stage"] != 3:
            fail("deepspeed.zero3_profile",
                 f"{ds['zero3_profile']} sets ZeRO-3's gathered parameters: needs zero_stage 3")
        if "nvme" in (ds["offload_optimizer"], ds["offload_param"]) and not ds["nvme_path"]:
            fail("deepspeed.nvme_path", "NVMe offload needs a nvme_path folder")

    def check_task(self, task, spec, fail):
        super().check_task(task, spec, fail)
        if spec.deepspeed["offload_param"] == "nvme" and "nvme_parameter_offload" in task.lacks:
            fail("deepspeed.offload_param", f"task {task.name}: {task.lacks['nvme_parameter_offload']}; NVMe "
                                            "parameter offload is not wired up for it")

    def parameter_layout(self, spec):
        return "deepspeed_partition" if spec.deepspeed.zero_stage == 3 else None

    def offloads_parameters(self, spec):
        return spec.deepspeed.offload_param != "none"

    def shards_checkpoint(self, spec):
        return spec.deepspeed["zero_stage"] >= 1

    def checkpoint_format(self, spec):
        ds = spec.deepspeed
        return (spec.precision, ds["zero_stage"], ds["offload_optimizer"], ds["offload_param"])

    def advisor_row(self, spec):
        ds = spec.deepspeed
        stage = ds["zero_stage"]
        if stage < 3:
            return ["ddp", "zero1", "zero2"][stage]
        if ds["offload_param"] != "none":
            return "zero3-offopt-offparam"
        return "zero3-offopt" if ds["offload_optimizer"] != "none" else "zero3"

    def module_precision(self, workload):
        return True

    def model_state(self, counts, n, precision, lora, settings):
        """Module in bf16/fp16 when precision asks (adapters included), else fp32 (w = 2 or 4):
        gradients w*T; Adam 8*T plus an fp32 master partition 4*T (ZeRO 1-3: 12*T/N); ZeRO-0 fp32
        keeps no master. ZeRO-1 shards the optimizer, ZeRO-2 + gradients, ZeRO-3 + weights.
        QLoRA (ZeRO 0-2): its `quantized` base weights at half a byte each."""
        psi = counts["total"]
        t = counts["trainable"] if lora else psi
        mixed = precision_layout(precision) == "mixed"
        w = 2 if mixed else 4
        stage = settings.get("zero_stage", 0)
        quantized = counts.get("quantized", 0)
        weights = w * (psi - quantized) + 0.5 * quantized
        if stage == 0:
            return state({"params": weights, "grads": w * t, "optimizer": (12 if mixed else 8) * t})
        if stage < 3:
            # ZeRO-1 reduce-scatters at the accumulation boundary: whole gradients live only
            # between the micro-batches of an accumulated step.
            whole = stage == 1 and settings.get("grad_accum", 1) > 1
            return state({"params": weights, "grads": w * t / (1 if whole else n), "optimizer": 12 * t / n})
        p_local, t_local = sharded_counts(counts, n, "zero3")
        # Parameters up to the persistence threshold stay whole on every rank beside their
        # partition; the auto profile keeps a model under its live limit gathered whole.
        limits = zero3_settings(settings, counts)
        persistent = sum(math.prod(shape) for shape, _ in counts.get("_shapes", [])
                         if math.prod(shape) <= limits["stage3_param_persistence_threshold"])
        held = {"params": w * (p_local + persistent), "grads": w * t_local, "optimizer": 12 * t / n}
        cpu = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
        whole = psi <= limits["stage3_max_live_parameters"]
        gathered = w * (psi - persistent if whole else counts["largest_unit"])
        if settings.get("offload_optimizer", "none") != "none":
            cpu["optimizer"] = held.pop("optimizer")
            cpu["grads"] = 4 * t / n  # the fp32 gradient partition the CPU optimizer steps on
            held["optimizer"] = 0.0
        if settings.get("offload_param", "none") != "none":
            cpu["params"], held["params"] = held["params"], 0.0
        return state(held, gathered, cpu)


SETTINGS = DeepSpeedSettings()

"""FSDP2's settings (the spec's `fsdp:` block): defaults, refusals, id part, checkpoint format
and memory formula. `via: accelerate` hands the run to the Accelerate strategy."""
from __future__ import annotations

from distlab.configuration.strategies.settings import (StrategySettings, block_schema, precision_layout,
                                                       sharded_counts, state)


class FSDPSettings(StrategySettings):
    name = "fsdp"
    defaults = {"reshard_after_forward": True, "cpu_offload": False, "via": "native"}
    schema = block_schema({
        "reshard_after_forward": {"description": "true: full shard (ZeRO-3-like); false: shard grad/optimizer only.",
                                  "type": "boolean"},
        "cpu_offload": {"description": "FSDP2 CPUOffloadPolicy.", "type": "boolean"},
        "via": {"description": "native FSDP2, or through Accelerate (CUDA only).", "enum": ["native", "accelerate"]},
    })
    ray_train = True
    dcp_checkpoint = True

    def runs_as(self, spec):
        return "accelerate" if self.accelerate_plugin(spec) else self.name

    def accelerate_plugin(self, spec):
        return "FSDP" if spec.fsdp.via == "accelerate" else None

    def accelerate_config(self, spec):
        if not self.accelerate_plugin(spec):
            return {}
        fsdp = spec.fsdp
        return {"fsdp_config": {
            "fsdp_version": 2,
            # The decoder layer class is found from the loaded model by the strategy
            # (distlab.runtime.model.decoder_layer_class), never named here.
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": bool(fsdp["reshard_after_forward"]),
            "fsdp_offload_params": bool(fsdp["cpu_offload"]),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }}

    def parameter_layout(self, spec):
        return None if self.accelerate_plugin(spec) else "dtensor"

    def offloads_parameters(self, spec):
        return bool(spec.fsdp.cpu_offload)

    def variant(self, spec):
        fs = spec.fsdp
        # "fullshard", not "full": the method part of the id is already "full"/"lora".
        parts = ["fullshard" if fs["reshard_after_forward"] else "gradop"]
        if fs["cpu_offload"]:
            parts.append("offload")
        if fs["via"] == "accelerate":
            parts.append("acc")
        return "-".join(parts)

    def check(self, spec, config, fail, shape):
        if spec.fsdp["via"] == "accelerate" and spec.device != "cuda":
            fail("fsdp.via", "FSDP through Accelerate is a CUDA path (on CPU Accelerate wraps DDP instead); "
                 "use via: native")

    def shards_checkpoint(self, spec):
        return True

    def checkpoint_format(self, spec):
        fs = spec.fsdp
        return (spec.precision, fs["reshard_after_forward"], fs["cpu_offload"])

    def advisor_row(self, spec):
        return "zero3-offopt-offparam" if spec.fsdp["cpu_offload"] else "zero3"

    def module_precision(self, workload):
        return workload.get("device") == "cuda"  # MixedPrecisionPolicy on CUDA; autocast on CPU

    def model_state(self, counts, n, precision, lora, settings):
        """fp32 shards (on CUDA a MixedPrecisionPolicy casts only the gathered copy): weights,
        gradients and AdamW over N (dim 0 padded to a multiple of N); CPUOffloadPolicy keeps all
        three in CPU RAM."""
        p_local, t_local = sharded_counts(counts, n, "fsdp")
        held = {"params": 4 * p_local, "grads": 4 * t_local, "optimizer": 8 * t_local}
        gathered = (2 if precision_layout(precision) == "mixed" else 4) * counts["largest_unit"]
        if settings.get("cpu_offload"):
            return state({"params": 0.0, "grads": 0.0, "optimizer": 0.0}, gathered, held)
        return state(held, gathered)


SETTINGS = FSDPSettings()

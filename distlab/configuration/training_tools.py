"""Config-time checks of three training tools an experiment may ask for (light: no torch):
QLoRA (`method: qlora`), regional compilation (`compile: true`) and profiler traces
(`profile: {steps: [a, b]}`). Each refusal names the field and says why the combination
cannot run; what runs is distlab.runtime.qlora, distlab.runtime.compiled and distlab.runtime.profiling.
"""
from __future__ import annotations

import importlib.util

from distlab.records.spec import SpecFields
from distlab.configuration.strategies.settings import strategy_key

# Where QLoRA's 4-bit base cannot go, and why (strategy_key: FSDP through Accelerate is "accelerate").
QLORA_REFUSED = {
    "deepspeed": "ZeRO-3 partitions every parameter as the model is built (deepspeed.zero.Init) and gathers it "
                 "in hooks; bitsandbytes quantises in from_pretrained and its packed Params4bit carries its "
                 "quantisation state on the Parameter, which a ZeRO-3 partition does not keep. ZeRO 0-2 run QLoRA "
                 "(only the adapters train, so only they are partitioned)",
    "fsdp": "FSDP2's fully_shard turns every parameter into a DTensor shard; bitsandbytes' Params4bit keeps its "
            "quantisation state (absmax, code, shape) on the Parameter object, which a DTensor shard does not "
            "carry (bnb_4bit_quant_storage makes the packed bytes shardable for FSDP1's flat parameters, not "
            "FSDP2's per-parameter DTensors); use ddp or accelerate",
    "tp": "tensor parallelism splits each Linear's weight into row or column DTensor shards; a packed 4-bit "
          "weight with its per-block absmax cannot be split along the layer's dimensions",
    "pp": "distlab's pipeline stages build each stage's layers from a meta-device model and load plain "
          "weights into them; bitsandbytes quantises at from_pretrained, which the stage loader does not use",
}

# Regional compilation (layer.compile() per decoder layer) was checked on the tiny model, 2 ranks,
# 3 steps, against the eager run: ddp, accelerate (DDP on the CPU), fsdp (FSDP2), tp, pp and
# DeepSpeed ZeRO-2 reached the same losses within 3e-7 with no graph break. ZeRO-3 did not:
ZERO3_COMPILE_REFUSAL = (
    "ZeRO-3 gathers and releases each parameter in module hooks inside the decoder layers, and dynamo breaks "
    "the compiled layer at them (55 graph breaks for the tiny 2-layer model here, steps 1.5x slower than eager); "
    "DeepSpeed compiles ZeRO-3 through its own engine.compile(), which "
    "distlab does not wire. Stages 0-2 compile")


def adapts(spec: SpecFields) -> bool:
    """Whether the run trains adapters on a frozen base (LoRA, QLoRA): its checkpoint holds the
    adapters only and its export is the PEFT adapter folder."""
    return spec.method in ("lora", "qlora")


def check_training_tools(spec: SpecFields, fail) -> None:
    """The refusals of method qlora, compile and profile (fail(field, message) raises)."""
    key = strategy_key(spec)
    if spec.method == "qlora":
        if key in QLORA_REFUSED and (key != "deepspeed" or spec.deepspeed["zero_stage"] == 3):
            fail("method", f"qlora under strategy {spec.strategy}: {QLORA_REFUSED[key]}")
        if importlib.util.find_spec("bitsandbytes") is None:
            fail("method", "qlora holds the base in 4 bits through bitsandbytes, which this Python does not have: "
                 "pip install 'bitsandbytes>=0.50,<0.52' (0.50 brings the CPU backend)")
        if spec.precision == "fp16":
            fail("precision", "qlora computes in bf16 (precision bf16) or fp32; fp16 is not offered")
        if spec.export["merge"]:
            fail("export.merge", "a QLoRA run's base is 4-bit: merge its adapters into the full-precision base "
                 "yourself (PeftModel.from_pretrained on it, then merge_and_unload); the export is the adapter "
                 "folder")
    if spec.compile:
        if spec.task != "causal-lm":
            fail("compile", f"regional compilation compiles a causal LM's decoder layers; task {spec.task} "
                 "has none")
        if key == "deepspeed" and spec.deepspeed["zero_stage"] == 3:
            fail("compile", f"compile under strategy deepspeed with zero_stage 3: {ZERO3_COMPILE_REFUSAL}")
        if spec.method == "qlora":
            fail("compile", "not checked here: distlab has not verified bitsandbytes' 4-bit matmul (a custom "
                 "autograd function over packed Params4bit) inside compiled layers against the eager losses, so it "
                 "refuses rather than run unchecked")
        if spec.untimed_steps < 1:
            fail("untimed_steps", "compile: true compiles during the first step; at least one untimed step keeps "
                 "compile time out of the steady-state step time")
    profile = spec.profile
    if profile:
        first, last = profile["steps"]
        if first > last:
            fail("profile.steps", f"[{first}, {last}]: the first step profiled comes after the last")
        if spec.steps is not None and last >= spec.steps:
            fail("profile.steps", f"step {last} is past the run's last step ({spec.steps - 1}; steps count from 0)")

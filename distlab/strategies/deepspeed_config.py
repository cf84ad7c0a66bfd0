"""The DeepSpeed JSON config of one experiment, every value from its spec, and the file it is
written to (run_files/deepspeed_config.json) and read back from."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from distlab.records.spec import Spec
from distlab.configuration.precision import deepspeed_precision
from distlab.configuration.strategies.deepspeed_settings import zero3_limits

CONFIG_NAME = "deepspeed_config.json"
# torch.optim.AdamW defaults, written out so the config file says what runs.
ADAM_BETAS = [0.9, 0.999]
ADAM_EPS = 1e-8


def uses_torch_adam(spec: Spec) -> bool:
    return spec.deepspeed["optimizer_impl"] == "torch"


# DeepSpeed's default gradient bucket, and the floor below which small models pay in latency.
DEEPSPEED_BUCKET = 500_000_000
SMALL_BUCKET = 5_000_000


def gradient_bucket_size(layer_params: int, largest_trainable: int, trainable: int) -> int:
    """ZeRO 1-3's gradient reduce bucket, in elements: one decoder layer's parameters, kept
    between 5e6 (smaller buckets mean more collectives: benchmarks/zero_buckets.py measured
    ZeRO-3 steps on the tests' tiny model 1.08x slower with one-layer buckets than with
    DeepSpeed's, 0.94x with these) and DeepSpeed's 5e8; never less than the largest
    trainable parameter (its gradient is copied into the bucket whole: an embedding can be
    larger than a layer) and never more than all trainable parameters (LoRA). DeepSpeed's 5e8 is allocated up front with
    contiguous gradients (ZeRO-3 at engine start): 2 GB per rank in fp32, 1 GB in bf16, on a
    GPU as real device memory whatever the model; on CPU untouched pages cost nothing, so only
    a GPU shows it. Hugging Face's "auto" sizes it as hidden_size^2 (about 1/12 of a Llama layer)."""
    layer = min(DEEPSPEED_BUCKET, max(SMALL_BUCKET, layer_params))
    return max(1, min(trainable, max(layer, largest_trainable)))


def deepspeed_config(spec: Spec, world_size: int, layer_params: int | None = None,
                     bucket_elements: int | None = None, hidden_size: int | None = None) -> dict:
    """The DeepSpeed JSON config of one experiment (every value from the spec; at ZeRO-3
    the gathered-parameter settings of its zero3_profile also from the model's decoder-layer
    size `layer_params` and `hidden_size`, zero3_limits; at ZeRO 1-3 the gradient buckets from
    `bucket_elements`, gradient_bucket_size)."""
    ds = spec.deepspeed
    cuda = spec.device == "cuda"
    zero: dict = {"stage": ds["zero_stage"]}
    if bucket_elements and ds["zero_stage"] >= 1:
        zero["reduce_bucket_size"] = bucket_elements
        if ds["zero_stage"] < 3:
            zero["allgather_bucket_size"] = bucket_elements  # stage 1-2's all-gather of updated params
    if ds["zero_stage"] == 3:
        zero.update(zero3_limits(ds.get("zero3_profile", "auto"), layer_params, hidden_size))
    # deepspeed.zero_config: the experiment's own zero_optimization keys (bucket sizes, ZeRO-3's
    # live-parameter limits) over the ones above; set only where an experiment asks.
    zero.update(ds.get("zero_config") or {})
    for key in ("offload_optimizer", "offload_param"):
        if ds[key] != "none":
            block = {"device": ds[key], "pin_memory": cuda}  # pinning needs a CUDA host allocator
            if ds[key] == "nvme":
                block["nvme_path"] = ds["nvme_path"]
            zero[key] = block
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.grad_accum,
        "train_batch_size": spec.micro_batch * spec.grad_accum * world_size,
        "optimizer": {"type": "AdamW", "params": {
            "lr": spec.lr, "weight_decay": spec.weight_decay, "betas": ADAM_BETAS, "eps": ADAM_EPS,
            # torch: torch.optim.AdamW, the implementation DDP runs (nothing to compile).
            # deepspeed: FusedAdam, or DeepSpeedCPUAdam when offloading (JIT-built ops).
            "torch_adam": uses_torch_adam(spec)}},
        # The spec's max_grad_norm (0 = off), the global norm other strategies clip to (distlab.runtime.clipping).
        "gradient_clipping": float(spec.max_grad_norm),
        "zero_optimization": zero,
        **deepspeed_precision(spec.precision),
        "steps_per_print": 2**31 - 1,  # the loop logs; keep the rank logs quiet
        "wall_clock_breakdown": False,
    }
    if uses_torch_adam(spec) and (ds["offload_optimizer"] != "none"):
        # DeepSpeed refuses a non-DeepSpeedCPUAdam optimizer with offload unless told.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def write_config(config: dict, folder: str | os.PathLike, name: str = CONFIG_NAME) -> str:
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return str(path)


def file_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()

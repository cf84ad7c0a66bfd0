"""Run by tests/test_precision_as_built.py in its own process (one gloo rank): build a model
under each of distlab's ZeRO-3 paths with DeepSpeed's CPU accelerator told that the CPU does
(or does not) support fp16, and print the dtypes of the parameters each path built.

argv: fp16_supported (0/1), precision (fp32/bf16), causal-LM model folder, SD model folder."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One rank, as torchrun would describe it (DeepSpeed reads LOCAL_RANK).
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")


def main() -> None:
    fp16_supported, precision, model_dir, sd_dir = sys.argv[1] == "1", sys.argv[2], sys.argv[3], sys.argv[4]
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    # The branch DeepSpeed takes by CPU feature (torch.ops.mkldnn._is_mkldnn_fp16_supported()),
    # forced: the same machine then stands for both CPU kinds this machine kind comes in.
    type(get_accelerator()).is_fp16_supported = lambda self: fp16_supported

    from distlab.configuration.precision import torch_dtype
    from distlab.strategies.deepspeed_config import deepspeed_config
    from distlab.strategies import deepspeed_load
    from distlab.strategies.deepspeed_load import build_partitioned, load_through_transformers
    from distlab.tasks.text_to_image.model import load_unet_partitioned
    from distlab.testing import resolve

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    spec = resolve({"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}, "precision": precision},
                   stage="deepspeed")
    config = deepspeed_config(spec, 1)
    dtype = torch_dtype(precision)
    built = {}

    def dtypes(model) -> list[str]:
        return sorted({str(getattr(p, "ds_tensor", p).dtype).replace("torch.", "") for p in model.parameters()})

    for name, build in [("causal_lm", lambda: build_partitioned(model_dir, config, dtype)),
                        ("transformers_route", lambda: load_through_transformers(model_dir, config, dtype)),
                        ("unet", lambda: load_unet_partitioned(sd_dir, config, dtype, zero=deepspeed_load)[0])]:
        try:
            built[name] = dtypes(build())
        except Exception as error:  # a refusal is an answer too: the test reads it
            built[name] = f"{type(error).__name__}: {error}"
    print("BUILT " + json.dumps(built), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

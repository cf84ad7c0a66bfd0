"""ZeRO-3's sharded load: every rank reads only its own partition of each weight from the
model folder's safetensors, so no rank ever holds (or maps) the whole checkpoint.

transformers' ZeRO-3 route (`from_pretrained` under HfDeepSpeedConfig) builds the model
under deepspeed.zero.Init, but then rank 0 reads the whole state dict and every parameter
is gathered whole on every rank while rank 0 copies it in: rank 0's load peak was 0.76x a
DDP rank's on a 155M model (the other rank 0.40x). Here instead:

1. The architecture is built under `deepspeed.zero.Init` with transformers' weight
   initialisation off (`no_init_weights`): each parameter is partitioned (and offloaded
   where configured) as its module is constructed, and never initialised randomly.
2. Each rank copies its flat slice of every parameter straight from the file. DeepSpeed
   partitions a parameter by flattening it, padding it to a multiple of the group size and
   giving rank r elements [r * p, (r + 1) * p) with p = `ds_tensor.ds_numel`
   (deepspeed.runtime.zero.partition_parameters `_partition_param`); the rows covering that
   range are read with safetensors' `get_slice`, the rest of the partition is padding (zeros).

NVMe parameter offload keeps partitions in swap buffers that are not plain tensors, and a
family whose stored weights transformers converts while loading (merged or split keys) cannot
be read piecewise: both load through transformers' route, and as_built's deepspeed.load says
which route ran and why.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distlab.runtime.partial_load import ShardedLoad, WeightFiles

ROUTE_RANK_SLICES = ("built under deepspeed.zero.Init (no weight init), then each rank copied only its own "
                     "partition of every weight from the safetensors (safetensors get_slice, rows covering it)")
ROUTE_TRANSFORMERS = ("transformers from_pretrained under HfDeepSpeedConfig: zero.Init construction, rank 0 "
                      "reads the whole state dict and each parameter is gathered to copy it in")


def load_partitioned(source: str, ds_config: dict, dtype, nvme_params: bool) -> tuple:
    """(model, load report): every rank reads its own partitions, except where that cannot work
    (module docstring), which loads through transformers and says why in the report."""
    if nvme_params:
        why = "NVMe parameter offload keeps partitions in swap buffers"
    else:
        model = build_partitioned(source, ds_config, dtype)
        try:
            return model, load_rank_partitions(model)
        except NotImplementedError as exc:  # raised before any weight is read, on every rank alike
            del model
            why = str(exc)
    return load_through_transformers(source, ds_config, dtype), {"how": ROUTE_TRANSFORMERS, "why": why}


def config_dtype(ds_config: dict):
    """The dtype a DeepSpeed config's `bf16`/`fp16` blocks keep the module in (fp32 when neither)."""
    if (ds_config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def zero_init(ds_config: dict, dtype):
    """`deepspeed.zero.Init` that builds every parameter in `dtype`, on every CPU and GPU.

    DeepSpeed 0.19.7/0.19.8 `Init._set_dtype` (deepspeed/runtime/zero/partition_parameters.py)
    reads a given dtype as
    `dtype or torch.float16 if get_accelerator().is_fp16_supported() else torch.bfloat16 if ...`:
    by Python's precedence the given dtype is used only where the accelerator supports fp16, and
    on a CPU without AVX512-FP16/AMX-FP16 an fp32 run is built in bf16. With `dtype=None` the same
    method takes the dtype from the config's bf16/fp16 blocks, which every DeepSpeed path honours,
    so the dtype is passed that way, and a config that implies another dtype is refused here
    rather than silently built in it."""
    import deepspeed

    implied = config_dtype(ds_config)
    if implied != dtype:
        raise ValueError(f"zero.Init asked for {dtype} parameters but the DeepSpeed config's bf16/fp16 blocks "
                         f"imply {implied}")
    return deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=None)


def check_built_dtype(model, dtype, what: str) -> None:
    """Fail when any parameter of a model built under zero_init is not in `dtype` (the partition
    a rank holds, ds_tensor, and the parameter's own dtype alike)."""
    wrong = {}
    for name, param in model.named_parameters():
        held = getattr(param, "ds_tensor", param)
        for tensor in (param, held):
            if tensor.dtype != dtype:
                wrong.setdefault(str(tensor.dtype).replace("torch.", ""), name)
    if wrong:
        raise RuntimeError(f"{what} was asked for {str(dtype).replace('torch.', '')} parameters but DeepSpeed built "
                           + ", ".join(f"{kind} ones (e.g. {name})" for kind, name in sorted(wrong.items())))


def build_partitioned(source: str, ds_config: dict, dtype):
    """The causal LM of `source`, every parameter a ZeRO-3 partition, weights not yet read."""
    import contextlib

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import initialization
    from transformers.integrations import deepspeed as hf_deepspeed

    config = AutoConfig.from_pretrained(str(source))
    # prevent_arange_dtype_change: zero.Init would cast the rotary buffers' arange to a bf16
    # run's dtype; transformers enters it before its own zero.Init from the release that has
    # it (5.24 does; 5.17 and 5.0 did not, and neither did their ZeRO-3 route). Where it is
    # missing, distlab.runtime.buffers puts the plain model's buffers back (model_setup).
    keep_arange = getattr(hf_deepspeed, "prevent_arange_dtype_change", contextlib.nullcontext)
    with initialization.no_init_weights(), keep_arange(), zero_init(ds_config, dtype):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # built without weights, the head is left untied: it is never stored on its own
    check_built_dtype(model, dtype, "the ZeRO-3 causal LM")
    model.distlab_source = str(source)
    return model


def load_through_transformers(source: str, ds_config: dict, dtype):
    """transformers' ZeRO-3 route (ROUTE_TRANSFORMERS): from_pretrained under HfDeepSpeedConfig."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from distlab.runtime.model import load_model

    # transformers holds only a weak reference: alive while loading, then released. Left
    # alive, every later from_config/from_pretrained on rank 0 alone (the export's reload
    # check, held-out evaluation) would enter zero.Init, a collective, and hang.
    if config_dtype(ds_config) != dtype:  # transformers' zero.Init takes its dtype from the config
        raise ValueError(f"ZeRO-3 load asked for {dtype} but the DeepSpeed config implies {config_dtype(ds_config)}")
    hf_deepspeed_config = HfDeepSpeedConfig(ds_config)
    try:
        model = load_model(source, dtype=dtype)
        check_built_dtype(model, dtype, "the ZeRO-3 causal LM (transformers' route)")
        return model
    finally:
        del hf_deepspeed_config
        unset_hf_deepspeed_config()


def flat_range(stored, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the row-major flattening of a safetensors slice, reading only
    the rows that cover them."""
    shape = list(stored.get_shape())
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    first, last = start // row, -(-stop // row)
    rows = stored[first:last]
    return rows.reshape(-1)[start - first * row: stop - first * row]


class ZeroPartitions(ShardedLoad):
    """ZeRO-3's placement: each rank copies its flat slice of every parameter (the rows of the
    stored tensor that cover it, _copy_partition)."""

    loader = "ZeRO-3"

    def __init__(self, model):
        self.files = WeightFiles(model)  # NotImplementedError: weights converted on load
        super().__init__(model, self.files.folder)

    def stored(self):
        return self.files.names

    def load_layer(self, names, params):
        with torch.no_grad():
            return sum(_copy_partition(params[name], self.files.slice(name)) for name in names)

    def after_layer(self):
        self.files.close()  # unmap: the pages read stay in RSS while the file is open

    def finish(self, bytes_read):
        return {"how": ROUTE_RANK_SLICES, "bytes_read": bytes_read, "tensors": sum(1 for _ in self.model.parameters())}


def load_rank_partitions(model) -> dict:
    """Copy this rank's partition of every parameter of a build_partitioned model from its
    safetensors; raises naming any parameter the file does not hold (before reading any)."""
    return ZeroPartitions(model).run()


def _copy_partition(param, stored) -> int:
    """This rank's flat slice of `param` from its stored tensor; returns the bytes read."""
    part = param.ds_tensor
    size = part.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    stop = min(start + size, param.ds_numel)
    part.zero_()  # the padding past the parameter's last element
    if stop <= start:
        return 0
    values = flat_range(stored, start, stop)
    part[: stop - start].copy_(values.to(part.dtype))
    return values.numel() * values.element_size()

"""What a DeepSpeed engine holds per rank: the distinct tensor storages of its module, ZeRO
optimizer and buffers by category (measured), beside DeepSpeed's own estimator (predicted)."""
from __future__ import annotations

import torch


def estimator_bytes(ds: dict, total_params: int, largest_layer_params: int, world_size: int,
                    zero_init: bool = False) -> dict:
    """DeepSpeed's own per-device model-state estimate (it assumes 16-bit params and grads
    with fp32 master weights and Adam state); stages 0 and 1 have no DeepSpeed estimator.
    zero_init: ZeRO-3 built the model under deepspeed.zero.Init (the route distlab's loader
    takes, as_built.deepspeed.partitioned_at_load), so no rank held the whole model in CPU RAM."""
    stage = ds["zero_stage"]
    offload_opt = ds["offload_optimizer"] != "none"
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, device = estimate_zero2_model_states_mem_needs(total_params, world_size, 1, cpu_offload=offload_opt)
        name = "estimate_zero2_model_states_mem_needs"
    elif stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, device, _ = estimate_zero3_model_states_mem_needs(
            total_params, largest_layer_params, world_size, 1, cpu_offload=offload_opt,
            cpu_offload_params=ds["offload_param"] != "none", zero_init=zero_init)
        name = "estimate_zero3_model_states_mem_needs"
    else:
        return {"function": None, "device_bytes": None, "cpu_bytes": None,
                "why": f"DeepSpeed ships no estimator for ZeRO stage {stage}"}
    return {"function": name, "device_bytes": int(device), "cpu_bytes": int(cpu), "total_params": total_params,
            "largest_layer_params": largest_layer_params, "world_size": world_size,
            **({"zero_init": zero_init} if stage == 3 else {})}


def _tensors(obj, depth=0):
    """(tensor, is_a_grad) for tensors and their .grad reachable through lists, tuples, dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj, False
        if obj.grad is not None:
            yield obj.grad, True
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _category(attribute: str) -> str:
    """ZeRO optimizer attribute -> model-state category (names of DeepSpeed 0.17-0.19)."""
    name = attribute.lower()
    if "grad" in name:
        return "grads"
    if "fp32" in name or "single_partition" in name:
        return "optimizer"  # fp32 master partition: part of K=12 in the ZeRO paper
    if any(key in name for key in ("param", "bit16", "fp16", "lp_")):
        return "params"
    return "other"


def engine_state_bytes(engine, offload: dict) -> dict:
    """Bytes of the distinct tensor storages this rank holds, by category: module params
    (incl. ZeRO-3 partitions), grads, optimizer state (incl. fp32 master partitions) and
    every other tensor buffer of the ZeRO optimizer. Each storage is counted once, by
    the first category that claims it. State DeepSpeed offloads is reported separately."""
    module, zero_opt, basic = engine.module, engine.optimizer, engine.basic_optimizer
    claims = [("params", [t for p in module.parameters() for t in (p, getattr(p, "ds_tensor", None))
                          if t is not None]),
              ("grads", [p.grad for p in module.parameters() if p.grad is not None]),
              ("optimizer", [t for state in basic.state.values() for t, _ in _tensors(state)])]
    if zero_opt is not basic:
        for attribute, value in vars(zero_opt).items():
            if attribute in ("optimizer", "loss_scaler"):
                continue
            for tensor, is_grad in _tensors(value):
                claims.append(("grads" if is_grad else _category(attribute), [tensor]))
        # The gradient reduce buckets sit in bucket objects (ipg_buckets: dtype -> bucket).
        for bucket in (getattr(zero_opt, "ipg_buckets", None) or {}).values():
            claims.append(("other", [t for t, _ in _tensors(getattr(bucket, "buffer", None))]))
    seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0, "other": 0}
    offloaded = {"offloaded_params": 0, "offloaded_grads": 0, "offloaded_optimizer": 0}
    for category, tensors in claims:
        for tensor in tensors:
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), tensor.device.type)
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            off_key = f"offloaded_{category}"
            if off_key in offloaded and _is_offloaded(tensor, category, engine, offload):
                offloaded[off_key] += storage.nbytes()
            else:
                out[category] += storage.nbytes()
    out.update(offloaded)
    out["how"] = ("distinct tensor storages held by this rank: module params and ZeRO-3 partitions, grads and "
                  "ZeRO grad buffers, Adam state and fp32 master partitions ('other': remaining ZeRO buffers, the "
                  "gradient reduce buckets included); offloaded_*: state DeepSpeed keeps off the accelerator (on a CPU "
                  "run: what the config offloads)")
    return out


def _is_offloaded(tensor, category: str, engine, offload: dict) -> bool:
    if engine.device.type != "cpu":
        return tensor.device.type != engine.device.type
    # On a CPU run every tensor is in host memory: offloaded = what the config moves off the device.
    if category == "params":
        # ZeRO-3 partitions are flat (1-D); gathered or persistent module params are not.
        return offload["offload_param"] != "none" and tensor.dim() == 1
    return offload["offload_optimizer"] != "none"

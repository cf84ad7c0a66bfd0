"""Native FSDP2 (`torch.distributed.fsdp.fully_shard`): every parameter is a DTensor
sharded on dim 0 over a 1-D device mesh; each decoder layer is one all-gather unit.

reshard_after_forward=True frees the gathered layer after its forward (full shard,
ZeRO-3-like); False keeps it until backward (the SHARD_GRAD_OP / ZeRO-2 equivalent).
No rank holds the whole model, at load either (torchtitan's recipe): the model is built on
the meta device (buffers real), LoRA is applied there, every decoder layer and then the
root is fully_shard-ed, `to_empty` gives each rank memory for its shards only, and the
base weights are read from the Hugging Face safetensors by torch.distributed.checkpoint's
HuggingFaceStorageReader, each rank reading only its slices (distlab.strategies.fsdp_load).

Checkpoints are sharded DCP folders (each rank writes its own shard of the trainable
parameters and the optimizer: distlab.checkpoint_formats.dcp, shared with the tensor- and
pipeline-parallel strategies). The export gathers one parameter at a time (full_tensor,
Strategy.state_groups).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from distlab.runtime.accumulation import for_backward
from distlab.checkpoint_formats.dcp import dcp_load, dcp_save
from distlab.runtime.model import decoder_layers
from distlab.configuration.precision import is_mixed, low_precision_dtype
from distlab.strategies.base import FidelityError, Strategy



class FSDPStrategy(Strategy):
    name = "fsdp"
    expected_wrappers = ("FSDPModule",)
    mixed_precision = False  # set by wrap()

    def load_model(self, model_source: str):
        self.model_source = self.task.weights_folder(model_source)  # where wrap() reads each rank's slices
        # fp32 parameters: FSDP's sharded parameters are the optimizer's masters (a
        # MixedPrecisionPolicy casts the gathered copy for compute).
        return self.task.load_model(model_source, dtype=torch.float32, device="meta")

    def lora_context(self):
        from distlab.strategies.fsdp_load import keep_adapter_init

        return keep_adapter_init()

    def wrap(self, model) -> None:
        from distlab.strategies.fsdp_load import materialize_sharded

        device = self.ctx.device
        fs = self.spec.fsdp
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # On CPU ranks too: FSDP2 casts the gathered parameters itself (torch 2.6+ over gloo,
        # checked at 1 and 2 ranks), so CPU runs the policy the GPU runs. fp16 is refused on CPU
        # by the config (no fp16 autocast there).
        self.mixed_precision = is_mixed(self.spec.precision)
        kwargs = {"mesh": self.mesh, "reshard_after_forward": fs["reshard_after_forward"]}
        if self.mixed_precision:
            # Compute in low precision, reduce gradients in fp32 (the usual FSDP recipe).
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low_precision_dtype(self.spec.precision),
                                                       reduce_dtype=torch.float32)
        # pin_memory needs a CUDA runtime; on CPU ranks the "offload" target is the device itself.
        kwargs["offload_policy"] = (CPUOffloadPolicy(pin_memory=device.type == "cuda") if fs["cpu_offload"]
                                    else OffloadPolicy())
        on_meta = any(p.device.type == "meta" for p in model.parameters())
        if not on_meta and not fs["cpu_offload"]:
            model.to(device)  # a caller handed over a materialised model: shard it in place
        self.layers = decoder_layers(model)
        for layer in self.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)  # the root: embeddings, final norm, head
        self.load_report = {"how": "materialised model passed to wrap(), sharded in place"}
        if on_meta:
            # CPUOffloadPolicy keeps the shards in host memory; otherwise on the rank's device.
            self.load_report = materialize_sharded(model, self.model_source,
                                                   torch.device("cpu") if fs["cpu_offload"] else device)
        self.model = model
        self.optimizer = self.build_optimizer(self.trainable(model))

    def sync_context(self, is_last_micro: bool):
        # Accumulate unsharded gradients locally; reduce-scatter only on the last micro-batch.
        self.model.set_requires_gradient_sync(is_last_micro)
        return super().sync_context(is_last_micro)

    def forward_backward(self, batch, micro_index, n_micro, num_items):
        if not self.mixed_precision:
            return super().forward_backward(batch, micro_index, n_micro, num_items)
        # MixedPrecisionPolicy already casts parameters: autocast on top would be a second policy.
        with self.sync_context(micro_index == n_micro - 1):
            share = self.task.loss(self.model, batch, num_items)
            for_backward(share, self.gradient_divisor(n_micro)).backward()
        return share.detach()

    # -- truth --------------------------------------------------------------------------
    def describe(self) -> dict:
        out = super().describe()
        out["wrappers_found"] = ["FSDPModule"] if isinstance(self.model, FSDPModule) else []
        out.update(sharding_facts(self.model, self.layers))
        out["reshard_after_forward"] = resharding(self.layers)
        out["sharded_load"] = getattr(self, "load_report", None)
        out["mixed_precision"] = "MixedPrecisionPolicy" if self.mixed_precision else "none (fp32)"
        out["mixed_precision_policy"] = mixed_precision_policy(self.layers + [self.model])
        offload = self.spec.fsdp["cpu_offload"]
        out["cpu_offload"] = offload
        out["param_shard_devices"] = sorted({str(p.to_local().device) for p in self.model.parameters()
                                             if isinstance(p, DTensor)})
        if offload and self.ctx.device.type == "cpu":
            out["cpu_offload_note"] = ("CPUOffloadPolicy on CPU ranks: shards already live in host memory, so the "
                                       "offload moves nothing; it is measured for its overhead only")
        return out

    def verify(self, described: dict) -> None:
        super().verify(described)
        check_sharded(described, self.spec.world_size)
        if described["fsdp_layers"] != len(self.layers) or not self.layers:
            raise FidelityError(f"FSDP: {described['fsdp_layers']} of {len(self.layers)} decoder layers are "
                                "fully_shard units")
        wanted = ["cpu"] if self.spec.fsdp["cpu_offload"] else [str(self.ctx.device)]
        if described["param_shard_devices"] != wanted:
            raise FidelityError(f"FSDP shards live on {described['param_shard_devices']}, expected {wanted} "
                                f"(cpu_offload {self.spec.fsdp['cpu_offload']})")
        policy = described["mixed_precision_policy"]
        wanted = str(low_precision_dtype(self.spec.precision)) if self.mixed_precision else "None"
        if policy is not None and policy["param_dtype"] != wanted:
            raise FidelityError(f"FSDP units compute in {policy['param_dtype']}; spec precision "
                                f"{self.spec.precision}")
        resharded = described["reshard_after_forward"]
        if resharded is not None and resharded != self.spec.fsdp["reshard_after_forward"]:
            raise FidelityError(f"FSDP layers reshard after forward: {resharded}; spec asks for "
                                f"{self.spec.fsdp['reshard_after_forward']}")

    # -- the whole model and checkpoints -------------------------------------------------
    collective_forward = True  # every rank joins the all-gathers of each layer's forward

    def eval_context(self):
        # A MixedPrecisionPolicy already casts the gathered parameters (as in forward_backward).
        return contextlib.nullcontext() if self.mixed_precision else super().eval_context()

    def forward_logits(self, input_ids, every_rank=False, extra=None):
        with resharding_after_forward(self.model, self.spec.fsdp["reshard_after_forward"]):
            return super().forward_logits(input_ids, every_rank, extra)

    def save_checkpoint(self, path: str) -> None:
        dcp_save(self, path)

    def load_checkpoint(self, path: str) -> None:
        dcp_load(self, path)


@contextlib.contextmanager
def resharding_after_forward(model, setting: bool):
    """Evaluation forwards free each gathered layer after it ran, whatever the training
    setting: with reshard_after_forward False FSDP2 keeps a layer unsharded until its backward,
    and a forward without backward would leave the whole model gathered on every rank."""
    model.set_reshard_after_forward(True)
    try:
        yield
    finally:
        model.set_reshard_after_forward(setting)


def sharding_facts(model, layers) -> dict:
    """What fully_shard really did: DTensor parameters, their placements and mesh size."""
    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    meshes = sorted({p.device_mesh.size() for p in dtensors})
    placements = sorted({str(tuple(p.placements)) for p in dtensors})
    return {
        "parameters": len(params),
        "dtensor_parameters": len(dtensors),
        "sharded_on_dim0": sum(1 for p in dtensors if p.placements and isinstance(p.placements[0], Shard)
                               and p.placements[0].dim == 0),
        "mesh_sizes": meshes,
        "placements": placements,
        "fsdp_layers": sum(1 for layer in layers if isinstance(layer, FSDPModule)),
    }


def resharding(layers) -> bool | None:
    """Whether the layers' FSDP groups really free parameters after forward (read from the
    param group FSDP2 built; None when this torch keeps it elsewhere)."""
    try:
        groups = [layer._get_fsdp_state()._fsdp_param_group for layer in layers]
        flags = {g.post_forward_mesh_info is not None for g in groups if g is not None}
    except AttributeError:
        return None
    return flags.pop() if len(flags) == 1 else None


def mixed_precision_policy(units) -> dict | None:
    """The MixedPrecisionPolicy FSDP2 really holds for these fully_shard units (read from their
    param groups; None when this torch keeps it elsewhere)."""
    try:
        policies = {(str(p.param_dtype), str(p.reduce_dtype)) for p in
                    (unit._get_fsdp_state()._fsdp_param_group.mp_policy for unit in units)}
    except AttributeError:
        return None
    params, reduces = zip(*policies)
    return {"param_dtype": params[0] if len(set(params)) == 1 else sorted(set(params)),
            "reduce_dtype": reduces[0] if len(set(reduces)) == 1 else sorted(set(reduces))}


def check_sharded(described: dict, world_size: int) -> None:
    if described["dtensor_parameters"] != described["parameters"] or not described["parameters"]:
        raise FidelityError(f"FSDP: only {described['dtensor_parameters']} of {described['parameters']} parameters "
                            "are DTensors; the model is not sharded")
    if described["sharded_on_dim0"] != described["parameters"]:
        raise FidelityError(f"FSDP: parameters placed {described['placements']}, expected Shard(dim=0)")
    if described["mesh_sizes"] != [world_size]:
        raise FidelityError(f"FSDP: parameters sharded over meshes of size {described['mesh_sizes']}, spec "
                            f"world_size is {world_size}")


# The class distlab.strategies finds for the strategy name "fsdp" (its module name).
STRATEGY = FSDPStrategy

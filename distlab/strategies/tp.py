"""Tensor parallel (Megatron-style) with torch.distributed.tensor.parallel.

Inside each decoder layer the attention q/k/v and MLP gate/up projections are split by
output columns and o/down by input rows, so each layer needs one all-reduce forward and
one backward. Which linear gets which split comes from the model itself: Hugging Face
models declare it in `config.base_model_tp_plan` (the same plan `from_pretrained(tp_plan=
"auto")` uses); here it is applied with torch's parallelize_module so it runs on a CPU
(gloo) mesh as well as on CUDA. Attention modules size their heads from the projection
output (`view(..., -1, head_dim)`), so a rank simply sees heads/tp of them.

Every style a plan uses maps to a torch style (distlab.configuration.families.TP_STYLES): Phi-3's packed
qkv_proj / gate_up_proj are "colwise_gather_output" (split by columns, the output gathered
whole before the packed tensor is cut into q, k, v) followed by "rowwise_split_input".
A family without a plan (GPT-2) or with a style torch cannot express is refused at config
time. Entries outside the decoder layers (GPT-NeoX's embedding_rowwise, the LM head) are
left replicated: the embedding and head are held whole on every rank.

Loading: the model is built on the meta device, the layers are parallelized there, and each
rank then reads from the safetensors only its shard of every split weight (safetensors
`get_slice`, distlab.runtime.partial_load) and the replicated rest whole: no rank holds a full copy
of the split linears at any time.

Every TP rank computes the same batch: the data-parallel size is 1.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distlab.checkpoint_formats.dcp import dcp_load, dcp_save
from distlab.configuration.families import TP_STYLES
from distlab.runtime.model import decoder_layers, layer_plan
from distlab.configuration.model_files import empty_model
from distlab.runtime.partial_load import load_held_weights
from distlab.strategies.base import FidelityError, ModelParallel, Strategy

#: families.TP_STYLES' names made real; "replicate" (None) leaves the weight whole.
TORCH_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicate": None,
}
assert set(TORCH_STYLES) == set(TP_STYLES)


class TensorParallelStrategy(ModelParallel, Strategy):
    name = "tp"
    expected_wrappers = ()

    def load_model(self, model_source: str):
        """A meta-device skeleton: wrap() splits it, then each rank reads only its shards."""
        return empty_model(model_source)

    def wrap(self, model) -> None:
        if self.spec.method != "full":
            raise NotImplementedError("tensor parallel runs full fine-tuning only (LoRA wraps the split linears)")
        check_heads(model.config, dist.get_world_size())
        on_meta = any(p.device.type == "meta" for p in model.parameters())
        if not on_meta:
            model.to(self.ctx.device)
        self.mesh = init_device_mesh(self.ctx.device.type, (dist.get_world_size(),))
        self.plan = layer_plan(model)
        self.layers = decoder_layers(model)
        for layer in self.layers:
            parallelize_module(layer, self.mesh, {name: TORCH_STYLES[style]() for name, style in self.plan.items()})
        # Split on the meta device first, so each rank reads only its shards of the weights.
        self.loaded_bytes = load_held_weights(model, self.ctx.device)
        self.model = model
        self.optimizer = self.build_optimizer(self.trainable(model))

    def describe(self) -> dict:
        out = super().describe()
        split = {}
        for layer in self.layers:
            for name, module in layer.named_modules():
                weight = getattr(module, "weight", None)
                if isinstance(weight, DTensor):
                    split[name] = str(tuple(weight.placements))
        attn_heads = getattr(self.model.config, "num_attention_heads", None)
        out.update({
            "tp_degree": self.mesh.size(),
            "tp_plan": self.plan,
            "split_linears_per_layer": split,
            "split_linears": sum(1 for layer in self.layers for m in layer.modules()
                                 if isinstance(getattr(m, "weight", None), DTensor)),
            # A gathered output ("colwise_gather_output") means every rank runs every head.
            "heads_per_rank": (attn_heads // self.mesh.size() if set(self.plan.values()) <= {"colwise", "rowwise"}
                               else attn_heads) if attn_heads else None,
            "wrappers_found": ["parallelize_module"] if split else [],
            "weights_loaded_bytes": getattr(self, "loaded_bytes", None),
        })
        return out

    def verify(self, described: dict) -> None:
        super().verify(described)
        expected = len(self.plan) * len(self.layers)
        if described["split_linears"] != expected:
            raise FidelityError(f"tensor parallel: {described['split_linears']} linear layers are split, the plan "
                                f"asks for {expected}")
        if described["tp_degree"] != self.spec.world_size:
            raise FidelityError(f"tensor parallel degree {described['tp_degree']} but spec world_size "
                                f"{self.spec.world_size}")

    # Every rank computes every layer on its slices (forward_logits) and joins each split
    # weight's gather (full_tensor, Strategy.state_groups).
    collective_forward = True

    def save_checkpoint(self, path: str) -> None:
        dcp_save(self, path)

    def load_checkpoint(self, path: str) -> None:
        dcp_load(self, path)


def check_heads(config, degree: int) -> None:
    """Runtime twin of the config check, for models whose shape is only known once loaded."""
    for name in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, name, None)
        if count is not None and count % degree:
            raise ValueError(f"tensor parallel degree {degree} does not divide the model's {name} ({count})")



# The class distlab.strategies finds for the strategy name "tp" (its module name).
STRATEGY = TensorParallelStrategy

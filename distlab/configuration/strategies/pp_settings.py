"""Pipeline parallel's settings (the spec's `pp:` block): defaults, refusals (of the model's
shape, its family's pipeline plan, a diffusers UNet), id part and memory formula."""
from __future__ import annotations

import math

from distlab.configuration.families import pp_pieces
from distlab.configuration.strategies.settings import ModelParallelSettings, block_schema, state


class PPSettings(ModelParallelSettings):
    name = "pp"
    defaults = {"schedule": "gpipe", "microbatches": 4}
    schema = block_schema({
        "schedule": {"description": "Pipeline schedule.", "enum": ["gpipe", "1f1b"]},
        "microbatches": {"description": "Pipeline micro-batches each loop micro-batch is cut into (must divide "
                                        "micro_batch).", "type": "integer", "minimum": 1},
    })
    holds_layer_run = True
    needs_of_task = {"layer_stack": "pipeline parallel cuts a sequence of decoder layers passing one hidden state"}

    def variant(self, spec):
        return f"{spec.pp['schedule']}-m{spec.pp['microbatches']}"

    def check_shape(self, spec, fail, shape):
        layers = shape.get("num_hidden_layers")
        if layers is not None and layers < spec.world_size:
            fail("world_size", f"pipeline of {spec.world_size} stages needs at least that many decoder "
                 f"layers; the model has {layers}")
        if spec.world_size > 1 and shape.get("tie_word_embeddings"):
            fail("world_size", "pipeline stages cannot share the tied input/output embedding of this model "
                 "(tie_word_embeddings true); use world_size 1 or an untied model")
        if spec.micro_batch % spec.pp["microbatches"]:
            fail("pp.microbatches", f"micro_batch {spec.micro_batch} must divide into "
                 f"{spec.pp['microbatches']} pipeline micro-batches")

    def check(self, spec, config, fail, shape):
        super().check(spec, config, fail, shape)
        from distlab.configuration.data_checks import datasets_of, packing_mode

        data = datasets_of(config["data"]).get(spec.dataset)
        if data and packing_mode(data) == "documents":
            fail("dataset", f"dataset {spec.dataset!r} packs rows as documents (packing: documents, "
                 "the default for chat/instruction rows), whose position ids keep each row's attention to itself; "
                 "pipeline stages pass only hidden states on, so the later stages would attend across rows. "
                 "Set packing: none (one row per sequence) or blocks on that dataset for pipeline parallel")

    def family_refusal(self, model_config, world_size):
        """The family needs a pipeline plan (config.base_model_pp_plan) naming its decoder
        layers, untied embeddings across stages, and a layer for every stage."""
        if pp_pieces(model_config) is None:
            return ("it declares no pipeline plan (config.base_model_pp_plan) naming its decoder layers and what "
                    "runs before and after them, so its stages cannot be cut from the model's own forward")
        if world_size > 1 and model_config.tie_word_embeddings:
            return ("it ties its input and output embeddings (tie_word_embeddings true): one weight would live on "
                    "the first and the last stage; use world_size 1 or another strategy")
        layers = getattr(model_config, "num_hidden_layers", None)
        if layers is not None and layers < world_size:
            return f"a pipeline of {world_size} stages needs at least that many decoder layers; the model has {layers}"
        return None

    def model_state(self, counts, n, precision, lora, settings):
        """Rank 0 = the first stage: the input embedding and its run of decoder layers
        (strategies.pp.split_layers); LoRA's adapters sit in the layers."""
        layers = counts.get("layers")
        if not layers:
            return None
        t = counts["trainable"] if lora else counts["total"]
        first = math.ceil(layers / n)
        adapters = t * first / layers if lora else 0.0
        mine = counts["embedding"] + first * counts["per_layer"] + adapters
        mine_t = adapters if lora else mine
        return state({"params": 4 * mine, "grads": 4 * mine_t, "optimizer": 8 * mine_t})


SETTINGS = PPSettings()

"""Text-to-image's parse-time declaration: LoRA fine-tuning of a Stable Diffusion UNet
(diffusers' train_text_to_image_lora.py). What the config checks and the rules' paths need:
the `text_to_image` block copied into each spec, the refusals naming a field, the checks of
its model folder and image data (checks), and the files a job reads. Its rank-time half (the
UNet, the frozen encoders, the loss, the evaluation and export): distlab/tasks/text_to_image/.
"""
from __future__ import annotations

import copy

from distlab.configuration.tasks.declaration import TaskDeclaration

#: LoRA targets of diffusers' example (attention projections of every transformer block)
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def settings(config: dict) -> dict:
    """The config's text_to_image block (schema defaults filled)."""
    return config.get("text_to_image") or {}


class TextToImageDeclaration(TaskDeclaration):
    name = "text-to-image"
    unit = "image"
    lacks = {"tensor_parallel_plan": "a diffusers UNet has none",
             "layer_stack": "a UNet's skip connections cross every cut (down blocks feed the up blocks)",
             "nvme_parameter_offload": "the UNet's ZeRO-3 load copies each rank's partition into memory"}

    def id_part(self):
        return "sd"

    def resolve(self, spec, config):
        block = settings(config)
        # What a run depends on beyond the model and data folders (their files are its inputs).
        spec["text_to_image"] = {key: copy.deepcopy(block[key])
                                 for key in ("resolution", "center_crop", "random_flip", "interpolation", "samples")}
        if spec.lora["target_modules"] is None:
            spec["lora"]["target_modules"] = list(LORA_TARGETS)

    def check_config(self, config):
        from distlab.configuration.tasks.text_to_image import checks

        block = settings(config)
        if block["model"]["path"]:
            checks.check_model_folder(block["model"]["path"])
        checks.check_shapes(block)
        checks.check_data(block["data"], block["resolution"])

    def check_experiment(self, spec, config, fail):
        # What its UNet lacks (`lacks`: no transformers tp plan, skip connections across pipeline
        # cuts, a ZeRO-3 load not wired to NVMe) is weighed by each strategy's settings
        # (needs_of_task, check_task), checked by distlab.configuration.config before this.
        if spec.method != "lora":
            fail("method", "task text-to-image trains LoRA adapters on the UNet (diffusers' "
                           "train_text_to_image_lora.py); set method: lora")
        for key in ("dataset", "model"):
            if getattr(spec, key) != "default":
                fail(key, f"'{key}' picks a causal-LM {'data.extra' if key == 'dataset' else 'model.extra'} entry; "
                          "task text-to-image reads text_to_image.data and text_to_image.model")
        for key in ("epochs", "max_tokens"):
            if getattr(spec, key) is not None:
                fail(key, f"{key} is counted in a causal LM's token blocks; give task text-to-image its length "
                          "in steps")
        if spec.activation_checkpointing != "none":
            fail("activation_checkpointing", "distlab turns it on through transformers' layers; the diffusers UNet's "
                                             "own switch (enable_gradient_checkpointing) is not wired up")
        if spec.eval_every or spec.checkpoint_select != "last":
            fail("eval_every" if spec.eval_every else "checkpoint_select",
                 "held-out points during training measure a causal LM's token loss; task text-to-image evaluates "
                 "its UNet once, after the last step")
        if spec.rank_micro_batch is not None:
            fail("rank_micro_batch", "per-rank micro-batches weight each rank's loss by its share of the label "
                                     "tokens (distlab.runtime.unequal); task text-to-image has no label tokens")
        if spec.launcher == "ray":
            fail("launcher", "task text-to-image runs under torchrun and accelerate launch; its runs "
                             "under Ray Train have not been built or checked")

    def data_dir(self, spec, prep):
        return f"{prep}/sd-data"

    def model_file(self, spec, config, prep):
        path = settings(config).get("model", {}).get("path")
        return f"{path.rstrip('/')}/model_index.json" if path else f"{prep}/sd-model/model_index.json"

    def base_eval_path(self, spec, prep):
        return f"{prep}/eval/sd-base.json"


DECLARATION = TextToImageDeclaration()

"""The default task's parse-time declaration: causal language modelling on packed token blocks
(text, chat or instruction data). Its rank-time half: distlab/tasks/causal_lm.py."""
from __future__ import annotations

import os

from distlab.configuration.tasks.declaration import TaskDeclaration


def model_suffix(name: str) -> str:
    """Path suffix of a built model's files: "" for the base model, "_<name>" for model.extra.<name>."""
    return "" if name == "default" else f"_{name}"


class CausalLMDeclaration(TaskDeclaration):
    name = "causal-lm"
    unit = "token"
    advisor_sized = True

    def data_dir(self, spec, prep):
        return f"{prep}/data/{spec.dataset}-seq{spec.seq_len}"

    def model_file(self, spec, config, prep):
        return self.model_config_path(config, spec.model, prep)

    @staticmethod
    def model_config_path(config: dict, name: str, prep: str) -> str | None:
        """config.json of a model: the user's local folder, the one the pipeline builds, or
        None for the base model given as a hub id (loaded by id, no file to wait for)."""
        model = config["model"]
        if name == "default" and model.get("path"):
            return os.path.join(model["path"], "config.json")
        if name == "default" and model.get("hub_id"):
            return None
        return f"{prep}/model{model_suffix(name)}/config.json"

    def base_eval_path(self, spec, prep):
        return (f"{prep}/eval/base-{spec.dataset}-seq{spec.seq_len}"
                f"{model_suffix(spec.model)}.json")

    def units_per_sample(self, spec):
        return spec.seq_len


DECLARATION = CausalLMDeclaration()

"""The default task at rank time: causal language modelling on packed token blocks (text, chat or
instruction data), a Hugging Face causal LM, full fine-tuning or LoRA through peft. Its
parse-time declaration (data and model paths, units per sample): distlab/configuration/tasks/causal_lm.py.

Each method hands over to the module that always did the work (distlab.runtime.model, distlab.runtime.lora,
distlab.data_prep.data, distlab.runtime.evaluation, distlab.checkpoints.checkpoint,
distlab.tasks.causal_lm_outputs): this file is
where the rest of distlab meets them.
"""
from __future__ import annotations

from distlab.configuration.tasks.causal_lm import CausalLMDeclaration
from distlab.tasks.base import Task, TrainData, lazy


class TokenBlocks(TrainData):
    """A prepared data folder's packed blocks of one split, with their labels (-100 = a masked
    prompt token of chat/instruction data; none stored = every token is a label)."""

    def __init__(self, data_dir, split: str, seq_len: int):
        from distlab.data_prep.data import load_blocks, load_labels, load_positions

        self.blocks = load_blocks(data_dir, split)
        if self.blocks.shape[1] != seq_len:
            raise ValueError(f"data blocks are {self.blocks.shape[1]} tokens, spec seq_len is {seq_len}")
        self.labels = load_labels(data_dir, split)
        self.positions = load_positions(data_dir, split)  # packing documents: restarting per row

    def __len__(self) -> int:
        return len(self.blocks)

    def batch(self, indices, device, step):
        input_ids = self.blocks[indices].to(device, non_blocking=True)
        # Causal LM: packed text trains on every token; chat/instruction data only on the
        # response tokens (the rest -100). The loss shifts them (distlab.runtime.evaluation.loss_terms).
        labels = input_ids if self.labels is None else self.labels[indices].to(device, non_blocking=True)
        if self.positions is None:
            return {"input_ids": input_ids, "labels": labels}
        from distlab.data_prep.packing import packed_inputs

        return {"input_ids": input_ids, "labels": labels, **packed_inputs(self.positions[indices].to(device))}

    def describe(self) -> dict:
        return {"name": CausalLM.name}


class CausalLM(CausalLMDeclaration, Task):
    import_code = lazy("distlab.runtime.model:import_model_code")
    load_model = lazy("distlab.runtime.model:load_model")
    load_quantized = lazy("distlab.runtime.qlora:load_quantized")
    evaluate_trained = lazy("distlab.runtime.evaluation:evaluate_sharded")
    export_pass = lazy("distlab.checkpoints.export:export_pass")
    trained_outputs = lazy("distlab.tasks.causal_lm_outputs:streamed_outputs")
    check_export = lazy("distlab.tasks.causal_lm_outputs:check_export")
    lora_base_frozen = lazy("distlab.tasks.causal_lm_outputs:lora_base_frozen")

    def hidden_size(self, source):
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(str(source)), "hidden_size", None)

    def load_partitioned(self, source, ds_config, dtype, nvme_params, zero):
        return zero.load_partitioned(source, ds_config, dtype, nvme_params=nvme_params)

    def apply_lora(self, model, spec):
        if spec.method == "qlora":  # the base is 4-bit: peft's k-bit preparation first
            from distlab.runtime.qlora import apply_qlora

            return apply_qlora(model, spec)
        from distlab.runtime.lora import apply_lora

        return apply_lora(model, spec.lora, spec.seed)

    def flops(self, model, spec, count):
        from distlab.records.metrics import model_flops_per_token

        return model_flops_per_token(model, spec.seq_len, count=count)

    def train_data(self, job, spec, device, split="train"):
        return TokenBlocks(job.data_dir, split, spec.seq_len)

    def loss(self, model, batch, num_items=None):
        # The summed token loss from the logits, by the same function as the held-out
        # evaluation (not the model's own loss: a model that ignored num_items_in_batch would
        # silently return a mean again).
        from distlab.runtime.evaluation import loss_terms

        inputs = {name: value for name, value in batch.items() if name != "labels"}
        total, count = loss_terms(model(**inputs).logits, batch["labels"])
        return total / (count if num_items is None else num_items)

    def loss_items(self, batch):
        return (batch["labels"][..., 1:] != -100).sum()

    def data_facts(self, job, records_by_rank, ranks_per_replica):
        from distlab.data_prep.data import run_data_facts

        return run_data_facts(job.data_dir, records_by_rank, ranks_per_replica)


TASK = CausalLM()

"""Which strategies can run which model family, decided at config time from the model itself.

A Hugging Face model folder says what it is in config.json: `transformers.AutoConfig` reads
it (GPT-2's `n_embd`/`n_head` become `hidden_size`/`num_attention_heads`), the model type
names the causal-LM class, and the config class carries the two plans the model-parallel
strategies follow; this module reads them (`layer_tp_plan`, `pp_pieces`):

- tensor parallel uses `config.base_model_tp_plan` (which linear of a decoder layer splits
  how, the plan `from_pretrained(tp_plan="auto")` applies). A family without one (GPT-2) or
  with a style torch's parallel styles cannot express (packed or MoE splits) is refused.
- pipeline parallel uses `config.base_model_pp_plan` (the base model's children in forward
  order: what runs before the decoder layers belongs to the first stage, what runs after to
  the last). Each stage then runs the base model's own forward (masks, sliding windows,
  per-layer attention types, rotary embeddings, norms: all the model's own code), see
  distlab/strategies/pp.py. A family without the plan, or one that ties its input and output
  embeddings (GPT-2, Gemma: one weight on two stages), is refused.

What a strategy needs of a family is its own settings' `family_refusal`
(distlab/configuration/strategies/tp_settings.py, pp_settings.py), asked only of a strategy that declares
`splits_by_family_plan`: no strategy is named here, so a new one touches only its own files.
The data-parallel strategies call the model's own forward whole and run every causal-LM family
transformers ships (tests/test_families.py); they are not checked, so a config without a
model-splitting strategy never imports transformers at parse time.

The model distlab builds itself (`model.build`) is a Llama, whose shape checks live in
distlab/configuration/config.py and the strategies' check_shape; this module reads folders given by
`model.path`, and only for strategies that split the model: importing transformers (and
torch with it) costs seconds at Snakefile parse time, paid once per process (the config is
cached per folder).
"""
from __future__ import annotations

import functools
from pathlib import Path

from distlab.records.spec import SpecFields

#: Hugging Face tp-plan style -> the torch.distributed.tensor.parallel style it means
#: (transformers/distributed/tensor_parallel.py registers the same layouts for its own classes).
#: "replicate" keeps the full weight on every rank: nothing to parallelize.
TP_STYLES = {
    "colwise": "ColwiseParallel()",
    "rowwise": "RowwiseParallel()",
    "colwise_gather_output": "ColwiseParallel(output_layouts=Replicate())",
    "colwise_rep": "ColwiseParallel(output_layouts=Replicate())",
    "rowwise_split_input": "RowwiseParallel(input_layouts=Replicate())",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate())",
    "replicate": None,
}


@functools.lru_cache(maxsize=16)
def model_config(folder: str):
    """The folder's config through AutoConfig (no weights are read)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def causal_lm_class(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def layer_tp_plan(config) -> dict[str, str]:
    """{pattern inside a decoder layer: style} of the config's tp plan ("layers.*.x" -> "x");
    entries outside the decoder layers (embeddings, the LM head) stay replicated."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return {pattern.split(".*.", 1)[1]: style for pattern, style in plan.items() if ".*." in pattern}


def pp_pieces(config) -> tuple[list[str], str, list[str]] | None:
    """(children before the decoder layers, the layer list, children after) from the pp plan;
    the layer list is the entry that takes the attention mask. None without a usable plan."""
    plan = getattr(config, "base_model_pp_plan", None) or {}
    names = list(plan)
    layers = [name for name, (inputs, _) in plan.items() if "attention_mask" in inputs]
    if len(layers) != 1:
        return None
    at = names.index(layers[0])
    return names[:at], layers[0], names[at + 1:]


def refusal(folder: str, strategy, world_size: int) -> str | None:
    """Why `strategy` (its settings, distlab.configuration.strategies.settings: one with splits_by_family_plan)
    cannot run the model in `folder`, or None when it can; what it needs of the family is its
    own family_refusal."""
    config = model_config(str(Path(folder).resolve()))
    model_type = config.model_type
    model_class = causal_lm_class(model_type)
    if model_class is None:
        return f"transformers has no causal-LM class for model type '{model_type}'"
    why = strategy.family_refusal(config, world_size)
    if why is None:
        return None
    return f"strategy '{strategy.name}' cannot run model type '{model_type}' ({model_class}): {why}"


def check(spec: SpecFields, config: dict, fail, strategy) -> None:
    """Config-time gate (distlab.configuration.config.check_experiment) for the spec's strategy (its
    settings): fail('strategy', why) for a family it cannot split. Only a strategy that splits
    the model by the family's plans is checked, and only for a local `model.path` folder."""
    folder = config.get("model", {}).get("path")
    if not strategy.splits_by_family_plan or spec.model != "default":
        return  # a strategy that runs the model whole, or a model.extra entry (a built Llama)
    if not folder or not (Path(folder) / "config.json").is_file():
        return  # the built Llama (checked in config.py) or a hub id (read when the job loads it)
    why = refusal(folder, strategy, spec.world_size)
    if why:
        fail("strategy", why)

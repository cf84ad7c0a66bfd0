"""Which strategies can run which model family, decided at config time from the model itself.

A Hugging Face model folder says what it is in config.json: `transformers.AutoConfig` reads
it (GPT-2's `n_embd`/`n_head` become `hidden_size`/`num_attention_heads`), the model type
names the causal-LM class, and the config class carries the two plans the model-parallel
strategies follow:

- tensor parallel uses `config.base_model_tp_plan` (which linear of a decoder layer splits
  how, the plan `from_pretrained(tp_plan="auto")` applies). A family without one (GPT-2) or
  with a style torch's parallel styles cannot express (packed or MoE splits) is refused.
- pipeline parallel uses `config.base_model_pp_plan` (the base model's children in forward
  order: what runs before the decoder layers belongs to the first stage, what runs after to
  the last). Each stage then runs the base model's own forward (masks, sliding windows,
  per-layer attention types, rotary embeddings, norms: all the model's own code), see
  distlab/strategies/pp.py. A family without the plan, or one that ties its input and output
  embeddings (GPT-2, Gemma: one weight on two stages), is refused.

Data-parallel strategies (ddp, accelerate, deepspeed, fsdp) call the model's own forward
whole and run every causal-LM family transformers ships (tests/test_families.py); they are
not checked here, so a config without tp/pp never imports transformers at parse time.

The model distlab builds itself (`model.build`) is a Llama, whose shape checks live in
distlab/config.py and the tp/pp settings (distlab/strategies/tp_settings.py, pp_settings.py);
this module reads folders given by `model.path`, and only for tp and pp experiments: importing transformers (and torch with it) costs seconds at Snakefile parse
time, paid once per process (the config is cached per folder).
"""
from __future__ import annotations

import functools
from pathlib import Path

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


def tp_refusal(config, world_size: int) -> str | None:
    plan = layer_tp_plan(config)
    if not plan:
        return ("it declares no tensor-parallel plan for its decoder layers (config.base_model_tp_plan is "
                "empty), so nothing says which linear layers to split; use ddp, fsdp or deepspeed")
    unsupported = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unsupported:
        return (f"its tp plan uses style(s) {unsupported} that torch's tensor-parallel styles do not express "
                f"(supported: {sorted(TP_STYLES)})")
    for name in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, name, None)
        if count is not None and count % world_size:
            return f"tensor parallel degree {world_size} does not divide the model's {name} ({count})"
    return None


def pp_refusal(config, world_size: int) -> str | None:
    if pp_pieces(config) is None:
        return ("it declares no pipeline plan (config.base_model_pp_plan) naming its decoder layers and what "
                "runs before and after them, so its stages cannot be cut from the model's own forward")
    if world_size > 1 and config.tie_word_embeddings:
        return ("it ties its input and output embeddings (tie_word_embeddings true): one weight would live on "
                "the first and the last stage; use world_size 1 or another strategy")
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layers < world_size:
        return f"a pipeline of {world_size} stages needs at least that many decoder layers; the model has {layers}"
    return None


def refusal(folder: str, strategy: str, world_size: int) -> str | None:
    """Why `strategy` ('tp' or 'pp') cannot run the model in `folder`, or None when it can."""
    config = model_config(str(Path(folder).resolve()))
    model_type = config.model_type
    model_class = causal_lm_class(model_type)
    if model_class is None:
        return f"transformers has no causal-LM class for model type '{model_type}'"
    why = {"tp": tp_refusal, "pp": pp_refusal}[strategy](config, world_size)
    if why is None:
        return None
    return f"strategy '{strategy}' cannot run model type '{model_type}' ({model_class}): {why}"


def check(spec: dict, config: dict, fail) -> None:
    """Config-time gate (distlab.strategies.settings.ModelParallelSettings.check, for tp and pp):
    fail('strategy', why) for a refused combination."""
    folder = config.get("model", {}).get("path")
    if spec["strategy"] not in ("tp", "pp") or not folder or not (Path(folder) / "config.json").is_file():
        return  # the built Llama (checked in config.py) or a hub id (read when the job loads it)
    why = refusal(folder, spec["strategy"], spec["world_size"])
    if why:
        fail("strategy", why)

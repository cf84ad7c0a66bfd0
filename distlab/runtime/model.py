"""The base model: built once with a fixed seed, then loaded like any Hugging Face model."""
from __future__ import annotations


def build_base_model(build: dict, tokenizer, out_dir) -> dict:
    """A small Llama-architecture model saved with save_pretrained (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=build["hidden_size"],
        intermediate_size=build["intermediate_size"],
        num_hidden_layers=build["num_hidden_layers"],
        num_attention_heads=build["num_attention_heads"],
        num_key_value_heads=build["num_key_value_heads"],
        max_position_embeddings=build["max_position_embeddings"],
        tie_word_embeddings=build["tie_word_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(build["seed"])
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return {"parameters": sum(p.numel() for p in model.parameters()), "config": config.to_dict()}


def load_model(path_or_id: str, dtype=None, device: str | None = None):
    """Load through the Auto classes so a real local Llama/Mistral/Qwen folder works the same.

    dtype: the dtype the weights are kept in (default fp32). device="meta": the architecture
    only, no weight read and no memory for parameters (a strategy shards it, then loads each
    rank's part; distlab.strategies.fsdp). Buffers stay real on the CPU: the non-persistent ones
    (rotary inv_freq) are not in the checkpoint and are computed here, at construction."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
    if device == "meta":
        from accelerate import init_empty_weights

        config = AutoConfig.from_pretrained(str(path_or_id))
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.name_or_path = str(path_or_id)
        return model
    if device is not None:
        raise ValueError(f"load_model: device {device!r}, expected None or 'meta'")
    model, info = AutoModelForCausalLM.from_pretrained(str(path_or_id), dtype=dtype, output_loading_info=True)
    if info["missing_keys"]:  # from_pretrained would only warn and train those from random values
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{path_or_id}: the weight files lack {len(missing)} parameter(s) of "
                         f"{type(model).__name__}: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    return model


def import_model_code(path_or_id: str, lora: bool) -> None:
    """Import the modeling code a rank is about to use (the architecture's transformers
    module, peft for LoRA) without building anything: the RSS read right after it is then the
    process's own cost (interpreter, libraries, process group), and the model's share of a
    peak starts there. Importing a Llama's modeling code alone adds ~170 MiB of RSS here."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(path_or_id)))]
    except KeyError:
        pass  # not a causal LM transformers knows: load_model says so
    if lora:
        import peft  # noqa: F401


def decoder_layer_class(model):
    """The repeated block class (LlamaDecoderLayer, Qwen2DecoderLayer, ...), found, not named.

    Transformers models declare it in `_no_split_modules`; fall back to the class of the
    children of the largest ModuleList.
    """
    import torch

    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return type(max(lists, key=len)[0])


def decoder_layers(model) -> list:
    cls = decoder_layer_class(model)
    return [m for m in model.modules() if isinstance(m, cls)]


def linear_module_names(model) -> list[str]:
    """Leaf names of the linear layers inside decoder layers: LoRA's default targets."""
    import torch

    names = set()
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def layer_plan(model) -> dict[str, str]:
    """{name inside a decoder layer: style} from the model's declared base_model_tp_plan, for
    the styles that split something; a style outside TP_STYLES is refused. Tensor parallel splits
    by it (distlab.strategies.tp) and the parameter counts say what it splits (parameter_counts)."""
    import fnmatch

    from distlab.configuration.families import TP_STYLES, layer_tp_plan

    layer_names = {name for layer in decoder_layers(model)[:1] for name, _ in layer.named_modules()}
    out = {}
    for inner, style in layer_tp_plan(model.config).items():
        if style not in TP_STYLES:
            raise NotImplementedError(f"tensor parallel: plan style '{style}' for 'layers.*.{inner}' is not "
                                      f"supported (supported: {sorted(TP_STYLES)})")
        for name in layer_names:
            if fnmatch.fnmatchcase(name, inner) and TP_STYLES[style] is not None:
                out[name] = style
    if not out:
        raise NotImplementedError(f"tensor parallel: {type(model).__name__} declares no base_model_tp_plan for its "
                                  "decoder layers; cannot tell which linear layers to split")
    return out

"""The export written one tensor at a time is what save_pretrained writes, and the streamed
forward that every recorded logit comes from holds one decoder layer, not the model."""
from __future__ import annotations

import filecmp
import os

import pytest
from distlab.records.spec import Spec
import torch

from distlab.runtime.streamed import Skeleton, file_groups, open_weights, parameter_groups, streamed_logits


def tiny_llama(tied: bool, layers: int = 3):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config).eval()


def live_groups(model, main: bool = True):
    """What Strategy.state_groups yields for a model every rank holds whole (rank 0's view)."""
    params = dict(model.named_parameters())
    for names in parameter_groups(model):
        yield {n: params[n].detach() for n in names} if main else {}


@pytest.mark.parametrize("tied", [False, True])
def test_the_streamed_export_is_byte_for_byte_what_save_pretrained_writes(tmp_path, tied):
    from distlab.checkpoints.export import FullWeights
    from distlab.runtime.model import load_model

    model = tiny_llama(tied)
    model.save_pretrained(tmp_path / "reference", max_shard_size="20KB")
    skeleton = Skeleton(load_model(tmp_path / "reference", device="meta"))
    sink = FullWeights(skeleton.model, tmp_path / "streamed", "20KB")
    groups = list(live_groups(model))
    for group in reversed(groups):  # any arrival order: each tensor goes to its offset
        sink.add(skeleton, group)
    sink.close(skeleton)
    files = sorted(os.listdir(tmp_path / "reference"))
    assert files == sorted(os.listdir(tmp_path / "streamed"))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 2
    for name in files:
        assert filecmp.cmp(tmp_path / "reference" / name, tmp_path / "streamed" / name, shallow=False), name


def test_a_tensor_on_a_device_or_of_another_shape_is_refused_by_the_writer(tmp_path):
    from distlab.records.export_files import SafetensorsFile

    out = SafetensorsFile(tmp_path / "x.safetensors", {"w": ((2, 3), torch.float32)})
    with pytest.raises(ValueError, match="'w' is .*declared"):
        out.write("w", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="'w' is on meta"):
        out.write("w", torch.zeros(2, 3, device="meta"))
    with pytest.raises(ValueError, match="never written"):
        out.close()


@pytest.mark.parametrize("tied", [False, True])
def test_the_streamed_forward_holds_one_layer_and_gives_the_whole_models_logits(tmp_path, tied):
    model = tiny_llama(tied)
    model.save_pretrained(tmp_path / "model")
    from distlab.runtime.model import load_model

    skeleton = Skeleton(load_model(tmp_path / "model", device="meta"))
    held = []
    with open_weights(tmp_path / "model") as reader:
        logits = streamed_logits(skeleton, file_groups(skeleton, reader), torch.arange(16).reshape(2, 8),
                                 on_group=lambda sk, group: held.append(len(sk.resident)))
    with torch.no_grad():
        assert torch.equal(logits, model(input_ids=torch.arange(16).reshape(2, 8)).logits)
    per_layer = len(parameter_groups(model)[1])
    # One decoder layer at a time, plus the embedding while the first layer arrives (and, tied,
    # all along: it is also the head).
    assert max(held) <= per_layer + 1 and not skeleton.resident


def test_the_streamed_merged_lora_export_equals_peft_merge_and_unload(tmp_path):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from distlab.checkpoints.export import AdapterWeights, MergedWeights

    model = tiny_llama(False, layers=2)
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a merge of zeros would prove nothing
                param.normal_(std=0.1)
    spec = Spec({"method": "lora", "seed": 0, "lora": {"r": 4, "alpha": 8, "dropout": 0.0,
                                                      "target_modules": ["q_proj", "down_proj"]}})
    skeleton = Skeleton.for_run(str(tmp_path / "base"), spec)
    merged = MergedWeights(str(tmp_path / "base"), tmp_path / "merged", "5GB")
    adapters = AdapterWeights(tmp_path / "adapter")
    batch = torch.arange(16).reshape(2, 8)

    def both(sk, group):
        merged.add(sk, group)
        adapters.add(sk, group)

    logits = streamed_logits(skeleton, live_groups(peft_model), batch, on_group=both)
    merged.close(skeleton)
    adapters.close(skeleton)
    with torch.no_grad():
        assert torch.equal(logits, peft_model(input_ids=batch).logits)
        reference = peft_model.merge_and_unload().state_dict()
    written = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(written) == set(reference)
    assert max((written[k] - reference[k]).abs().max().item() for k in reference) < 1e-6
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

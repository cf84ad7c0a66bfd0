"""A CPU rank's glibc mmap threshold follows its model: fixed where a layer weight reaches it
(freed gathered and streamed layers then leave RSS), glibc's own where every layer is smaller
(nothing to return, and the step's large activations stay in the heap); every run says which."""
import pytest
import torch
from safetensors.torch import save_file

from conftest import resolve, run_experiment

from distlab.runtime import host_allocator
from distlab.runtime.host_allocator import HOST_MMAP_THRESHOLD


def weights_folder(tmp_path, layer_shape, embedding_rows=4096):
    """A model folder whose one decoder layer holds a weight of layer_shape, beside an
    embedding of embedding_rows x 256 (4 MiB at 4096: one-off, not a layer)."""
    save_file({"model.embed_tokens.weight": torch.zeros(embedding_rows, 256),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(*layer_shape)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("layer_shape, fixed", [((1024, 512), True), ((512, 512), False)])
def test_the_threshold_is_fixed_exactly_where_a_layer_weight_reaches_it(tmp_path, monkeypatch, layer_shape, fixed):
    monkeypatch.delenv("DISTLAB_MMAP_THRESHOLD", raising=False)
    choice = host_allocator.choose(weights_folder(tmp_path, layer_shape))
    assert choice["largest_layer_weight_bytes"] == layer_shape[0] * layer_shape[1] * 4
    assert choice["mmap_threshold_bytes"] == (HOST_MMAP_THRESHOLD if fixed else None), choice


def test_a_model_whose_layers_cannot_be_sized_keeps_the_fixed_threshold(tmp_path, monkeypatch):
    """No weight file to read (a hub id, an empty folder): the memory figures come first."""
    monkeypatch.delenv("DISTLAB_MMAP_THRESHOLD", raising=False)
    for source in (None, str(tmp_path), "org/some-model"):
        assert host_allocator.choose(source)["mmap_threshold_bytes"] == HOST_MMAP_THRESHOLD


def test_the_environment_variable_overrides_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_MMAP_THRESHOLD", "0")
    assert host_allocator.choose(weights_folder(tmp_path, (1024, 512)))["mmap_threshold_bytes"] is None
    monkeypatch.setenv("DISTLAB_MMAP_THRESHOLD", str(1 << 20))
    assert host_allocator.choose(weights_folder(tmp_path, (8, 8)))["mmap_threshold_bytes"] == 1 << 20


@pytest.mark.slow
def test_every_cpu_rank_records_the_threshold_it_ran_under(prepared, tmp_path, monkeypatch):
    """The tests' model is tiny: every layer weight is under 2 MiB, so its ranks run under
    glibc's dynamic threshold, and say so beside their RSS figures."""
    monkeypatch.delenv("DISTLAB_MMAP_THRESHOLD", raising=False)
    run = run_experiment(prepared, tmp_path / "run", resolve({"world_size": 2}, steps=2, untimed_steps=1),
                         checkpoint=False)
    for rank in run["memory"]["per_rank"]:
        allocator = rank["host_allocator"]
        assert allocator["mmap_threshold_bytes"] is None and allocator["applied"], allocator
        assert 0 < allocator["largest_layer_weight_bytes"] < HOST_MMAP_THRESHOLD

"""Loading only what a rank holds: the exact elements of its partition, read from the rows
that cover them, and no safetensors file left mapped (pages read stay in RSS while it is)."""
from pathlib import Path

import pytest


def test_a_ranks_flat_partition_is_read_from_the_rows_that_cover_it(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from distlab.strategies.deepspeed_load import flat_range

    tensors = {"matrix": torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7),
               "cube": torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5),
               "vector": torch.arange(11, dtype=torch.float32)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        for name, tensor in tensors.items():
            flat = tensor.reshape(-1)
            # Whole rows, partial first and last rows, inside one row, a single element.
            for start, stop in ((0, flat.numel()), (3, 17), (8, 12), (flat.numel() - 1, flat.numel()),
                                (flat.numel() // 2, flat.numel())):
                got = flat_range(handle.get_slice(name), start, stop)
                assert torch.equal(got, flat[start:stop]), (name, start, stop)


def mapped_files() -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if line.split()[-1].endswith(".safetensors")}


def test_loading_a_ranks_part_unmaps_the_safetensors_after_each_layer(prepared, monkeypatch, tmp_path):
    import json
    import shutil

    from distlab.configuration.model_files import empty_model
    from distlab.runtime.partial_load import WeightFiles, load_held_weights

    closes = []
    original = WeightFiles.close
    # A private copy: an earlier test of this worker process may still map the session model's
    # file, and only this load's own mapping is the one to see go.
    folder = str(shutil.copytree(prepared / "model", tmp_path / "model"))

    def recording_close(self):
        # (open handles, file mapped before the close, mapped after it)
        handles, before = len(self.handles), any(folder in path for path in mapped_files())
        original(self)
        closes.append((handles, before, any(folder in path for path in mapped_files())))

    monkeypatch.setattr(WeightFiles, "close", recording_close)
    model = empty_model(folder)
    loaded = load_held_weights(model, "cpu")
    layers = json.loads((tmp_path / "model" / "config.json").read_text())["num_hidden_layers"]
    assert loaded == 4 * sum(p.numel() for p in model.parameters())
    # One file, mapped while each layer is read and unmapped after it (and after the rest).
    assert closes == [(1, True, False)] * (layers + 1), closes


@pytest.mark.parametrize("loader", ["tp/pp", "zero3", "fsdp"])
def test_every_sharded_loader_refuses_a_folder_missing_a_weight_naming_it_before_reading_any(prepared, tmp_path,
                                                                                            monkeypatch, loader):
    """The three strategies' loads share one coverage check (distlab.runtime.partial_load.ShardedLoad):
    a parameter the model folder does not hold stops the load, named, before any weight is read."""
    import shutil

    from safetensors.torch import load_file, save_file

    from distlab.configuration.model_files import empty_model
    from distlab.runtime.partial_load import MissingWeights, RankSlices
    from distlab.strategies.deepspeed_load import ZeroPartitions
    from distlab.strategies.fsdp_load import DCPShards

    folder = shutil.copytree(prepared / "model", tmp_path / "model")
    weights = load_file(str(folder / "model.safetensors"))
    dropped = next(name for name in weights if ".layers.0." in name)
    save_file({k: v for k, v in weights.items() if k != dropped}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    model = empty_model(str(folder))
    load = {"tp/pp": lambda: RankSlices(model, "cpu"), "zero3": lambda: ZeroPartitions(model),
            "fsdp": lambda: DCPShards(model, str(folder), "cpu")}[loader]()
    read = []
    monkeypatch.setattr(type(load), "load_layer", lambda self, names, params: read.extend(names) or 0)
    with pytest.raises(MissingWeights, match=rf"1 parameters are not in the safetensors of .*{dropped}"):
        load.run()
    assert read == []


@pytest.mark.parametrize("names, groups", [
    (["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a", "model.norm.weight",
      "lm_head.weight"],
     [["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], ["model.layers.0.a", "model.layers.0.b"],
      ["model.layers.1.a"]]),
    (["model.layers.10.x", "model.layers.1.x"], [["model.layers.10.x"], ["model.layers.1.x"]]),
])
def test_weights_are_grouped_by_decoder_layer(names, groups):
    from distlab.runtime.partial_load import layer_groups

    assert layer_groups(names) == groups


ROUTES_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from distlab.strategies.deepspeed import skip_inference_shm_op
from distlab.strategies import deepspeed_load
import deepspeed

skip_inference_shm_op()
deepspeed.init_distributed(dist_backend="gloo")
source = sys.argv[1]
ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
sliced = deepspeed_load.build_partitioned(source, ds_config, torch.float32)
report = deepspeed_load.load_rank_partitions(sliced)
whole = deepspeed_load.load_through_transformers(source, ds_config, torch.float32)
theirs = dict(whole.named_parameters())
differ = [name for name, p in sliced.named_parameters()
          if not torch.equal(p.ds_tensor[: p.ds_numel], theirs[name].ds_tensor[: theirs[name].ds_numel])]
print(json.dumps({"differ": differ, "compared": len(theirs), "bytes_read": report["bytes_read"]}))
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_zero3_rank_slices_hold_exactly_what_transformers_zero3_load_gives(prepared, tmp_path):
    """Both ZeRO-3 load routes, one rank: every partition (here the whole flat parameter) equal."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", ROUTES_SCRIPT, str(prepared / "model")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compared"] > 0 and result["differ"] == [], result
    assert result["bytes_read"] > 0

"""Results and checkpoints travel between a GPU box and a CPU-only machine: a plain (DDP,
single-device) checkpoint saved on a GPU opens on a machine without one."""
from __future__ import annotations

import types

import pytest
import torch


def save_as_a_gpu_machine_does(state, path, monkeypatch):
    """torch.save with every storage tagged cuda:0, the location torch.save records for a CUDA
    tensor (the bytes are the same): the file a GPU machine writes for this state."""
    import torch.serialization

    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, path)


def test_a_plain_checkpoint_saved_on_a_gpu_machine_resumes_on_a_cpu_only_one(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from distlab.checkpoint_formats.plain import load_plain

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    save_as_a_gpu_machine_does(optimizer.state_dict(), tmp_path / "optimizer.pt", monkeypatch)
    if not torch.cuda.is_available():  # what the file holds: a plain torch.load here refuses it
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "optimizer.pt", weights_only=True)

    resumed = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    strategy = types.SimpleNamespace(unwrapped=lambda: resumed, optimizer=resumed_optimizer)
    load_plain(strategy, str(tmp_path))
    saved = optimizer.state_dict()["state"]
    loaded = resumed_optimizer.state_dict()["state"]
    assert sorted(loaded) == sorted(saved)
    for index, state in saved.items():
        assert loaded[index]["exp_avg"].device.type == "cpu"
        assert torch.equal(loaded[index]["exp_avg"], state["exp_avg"])
        assert torch.equal(loaded[index]["exp_avg_sq"], state["exp_avg_sq"])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

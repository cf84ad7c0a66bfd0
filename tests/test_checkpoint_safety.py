"""A checkpoint is data: a pickle planted in any native format distlab loads is refused by
distlab's loaders, and the code it carries never runs (its marker file is never created)."""
from __future__ import annotations

import json
import pickle
import types

import pytest
import torch

from distlab.checkpoints import checkpoint as ckpt
from distlab.checkpoint_formats.plain import load_plain
from distlab.checkpoints.safe_load import weights_only_loads


class Exploit:
    """Unpickling this creates the marker file: the proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker, raw_pickle: bool = False):
    """torch.save's format (what .pt/.bin loaders read), or a bare pickle (DCP's .metadata)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if raw_pickle:
        path.write_bytes(pickle.dumps(Exploit(marker), protocol=4))
    else:
        torch.save({"state": Exploit(marker)}, path)
    return path


def test_distlab_loads_a_deepspeed_checkpoint_without_running_a_planted_pickle(tmp_path, monkeypatch):
    """Through distlab.checkpoints.checkpoint.load_checkpoint, the one loader every strategy's load goes through."""
    pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    planted = _plant(tmp_path / "ckpt" / "state" / "final" / "mp_rank_00_model_states.pt", tmp_path / "marker")

    class DeepSpeedLike:  # DeepSpeed's own loader, as engine.load_checkpoint calls it
        def load_checkpoint(self, path):
            TorchCheckpointEngine().load(str(planted))

    monkeypatch.setattr(ckpt, "read_meta", lambda src: {"world_size": 1, "steps_done": 3})
    monkeypatch.setattr(ckpt, "check_compatible", lambda *a, **k: None)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load_checkpoint(tmp_path / "ckpt", DeepSpeedLike(), types.SimpleNamespace(spec={}), {}, verify=False)
    assert not (tmp_path / "marker").exists()
    TorchCheckpointEngine().load(str(planted))  # DeepSpeed alone: weights_only=False runs it
    assert (tmp_path / "marker").exists()


def test_dcp_metadata_and_items_cannot_run_code_under_distlab(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"weight": torch.ones(3), "extra": Exploit(tmp_path / "item-marker")}, checkpoint_id=str(folder))
    with weights_only_loads(), pytest.raises(dcp.api.CheckpointException, match="Weights only load failed"):
        dcp.load({"weight": torch.zeros(3), "extra": None}, checkpoint_id=str(folder))
    assert not (tmp_path / "item-marker").exists()
    _plant(folder / ".metadata", tmp_path / "meta-marker", raw_pickle=True)
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        dcp.FileSystemReader(str(folder)).read_metadata()
    assert not (tmp_path / "meta-marker").exists()
    dcp.FileSystemReader(str(folder)).read_metadata()  # torch alone: its pickle.load runs the planted code
    assert (tmp_path / "meta-marker").exists()


def test_a_real_dcp_checkpoint_still_loads_under_distlab(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.arange(3.0), "step": 7, "groups": [{"lr": 0.1}]}, checkpoint_id=str(tmp_path))
    state = {"weight": torch.zeros(3), "step": 0, "groups": [{"lr": 0.0}]}
    with weights_only_loads():
        dcp.load(state, checkpoint_id=str(tmp_path))
    assert torch.equal(state["weight"], torch.arange(3.0)) and state["step"] == 7 and state["groups"][0]["lr"] == 0.1


def test_accelerate_state_and_plain_optimizer_files_are_refused(tmp_path):
    from accelerate.utils import load as accelerate_load
    from safetensors.torch import save_model

    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        accelerate_load(_plant(tmp_path / "acc" / "optimizer.bin", tmp_path / "marker"), weights_only=False)

    class Plain:  # what load_plain needs of a strategy (DDP's and Ray's native format)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())

        def unwrapped(self):
            return self.model

    folder = tmp_path / "plain"
    folder.mkdir()
    save_model(Plain.model, str(folder / "model.safetensors"))
    _plant(folder / "optimizer.pt", tmp_path / "marker")
    with pytest.raises(pickle.UnpicklingError):
        load_plain(Plain(), str(folder))
    assert not (tmp_path / "marker").exists()


def test_trainer_state_is_json_and_safetensors_so_a_pickle_there_is_refused(tmp_path):
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "rank0.json").write_text(json.dumps({"steps_done": 1}))
    _plant(trainer / "rng-rank0.safetensors", tmp_path / "marker")
    with pytest.raises(Exception):
        ckpt._restore_trainer_state(tmp_path, 0, torch.device("cpu"), None)
    assert not (tmp_path / "marker").exists()


def test_loading_a_checkpoint_of_another_strategy_does_not_import_deepspeed(tmp_path):
    """DeepSpeed's data classes are allow-listed only where DeepSpeed is loaded (its engine is
    the only reader of its checkpoints): validating a DDP/FSDP checkpoint spent ~1 s of CPU
    importing DeepSpeed (and, through it, MLflow) for nothing."""
    import subprocess
    import sys

    torch.save({"weight": torch.ones(2)}, tmp_path / "state.pt")
    code = ("import sys, torch\nfrom distlab.checkpoints.safe_load import weights_only_loads\n"
            f"with weights_only_loads():\n    torch.load({str(tmp_path / 'state.pt')!r})\n"
            "print(sorted(m for m in ('deepspeed', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _PickledAsGetattr:
    """Pickles as getattr(target, name), as Python 3.11.2 pickles an enum member."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


def test_an_enum_member_pickled_through_getattr_loads_and_any_other_getattr_is_refused():
    """The metadata of a DCP checkpoint saved under Python 3.11.2 names builtins.getattr for its
    memory-format enum; the restricted unpickler resolves exactly that, on whichever Python runs
    the tests (the pickles are made by hand)."""
    import pathlib

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from distlab.checkpoints.safe_load import _restricted_pickle_loads

    member = next(iter(_MEM_FORMAT_ENCODING))
    assert _restricted_pickle_loads(pickle.dumps(_PickledAsGetattr(_MEM_FORMAT_ENCODING, member.name))) is member
    with pytest.raises(pickle.UnpicklingError, match="not an allow-listed enum member"):
        _restricted_pickle_loads(pickle.dumps(_PickledAsGetattr(pathlib.PosixPath, "cwd")))
    # torch.load (DeepSpeed's checkpoints: its ZeroStageEnum) under weights_only_loads, the same way
    import io

    for target, name, loads in ((_MEM_FORMAT_ENCODING, member.name, True), (pathlib.PosixPath, "cwd", False)):
        buffer = io.BytesIO()
        torch.save({"x": _PickledAsGetattr(target, name)}, buffer)
        buffer.seek(0)
        with weights_only_loads():
            if loads:
                assert torch.load(buffer)["x"] is member
            else:
                with pytest.raises(pickle.UnpicklingError):
                    torch.load(buffer)

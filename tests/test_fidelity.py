"""The fidelity check reads the truth from the model (where its parameters live, in what form)
and fails a run whose reality differs from its label."""
from __future__ import annotations

import pytest
import torch

from conftest import resolve
from distlab.strategies.base import FidelityError, RunContext, Strategy
from distlab.records.spec import Spec


class _Labelled(Strategy):
    """A strategy whose model is whatever the test hands it: the label is all it claims."""

    def wrap(self, model) -> None:
        self.model = model


def _verify(spec: dict, model, ctx_device: str, name: str = "ddp", expected_wrappers=(), monkeypatch=None):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda: spec["world_size"])
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl" if ctx_device == "cuda" else "gloo")
    strategy = type("S", (_Labelled,), {"name": name, "expected_wrappers": expected_wrappers})(
        RunContext(spec=spec, run_dir="", device=torch.device(ctx_device)))
    strategy.wrap(model)
    strategy.verify(strategy.describe())


def test_a_run_labelled_cuda_whose_parameters_are_on_the_cpu_fails(monkeypatch):
    spec = Spec(dict(resolve({"world_size": 1, "micro_batch": 8}), device="cuda"))
    with pytest.raises(FidelityError, match=r"parameters live on \['cpu'\]"):
        _verify(spec, torch.nn.Linear(4, 4), "cuda", monkeypatch=monkeypatch)


def test_a_run_labelled_fsdp_whose_model_is_plain_fails_even_with_a_lookalike_wrapper(monkeypatch):
    class FSDPModule(torch.nn.Module):  # the class name the label check looks for, sharding nothing
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

    spec = resolve({"strategy": "fsdp", "world_size": 2, "micro_batch": 2}, "fsdp")
    with pytest.raises(FidelityError, match="should hold its parameters as dtensor"):
        _verify(spec, FSDPModule(), "cpu", name="fsdp", expected_wrappers=("FSDPModule",), monkeypatch=monkeypatch)


def test_a_plain_model_on_the_spec_device_passes(monkeypatch):
    _verify(resolve({"world_size": 1, "micro_batch": 8}), torch.nn.Linear(4, 4), "cpu", monkeypatch=monkeypatch)

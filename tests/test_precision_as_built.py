"""A run holds its parameters in the dtype its precision says, on every CPU this machine kind
comes in, and a run that does not is failed as a label mismatch (as a wrong world size is)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

PROBE = REPO / "tests" / "zero_init_probe.py"


@pytest.fixture(scope="module")
def sd_model(tmp_path_factory):
    from distlab.configuration.config import validate_schema
    from distlab.tasks.text_to_image.prepare import build_tiny_sd
    from distlab.testing import tiny_config

    folder = tmp_path_factory.mktemp("sd-model")
    build_tiny_sd(validate_schema(tiny_config({}))["text_to_image"]["model"]["build"], folder)
    return folder


def built_dtypes(fp16_supported: bool, precision: str, prepared, sd_model) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(PROBE), "1" if fp16_supported else "0", precision,
                           str(prepared / "model"), str(sd_model)], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BUILT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("BUILT "):])


@pytest.mark.slow
@pytest.mark.parametrize("fp16_supported", [False, True], ids=["cpu-without-fp16", "cpu-with-fp16"])
def test_every_zero3_path_builds_an_fp32_runs_parameters_in_fp32_whatever_the_cpu(prepared, sd_model,
                                                                                   fp16_supported):
    # DeepSpeed 0.19.7/0.19.8 built these in bf16 where the CPU lacks fp16 (zero.Init's _set_dtype).
    assert built_dtypes(fp16_supported, "fp32", prepared, sd_model) == {
        "causal_lm": ["float32"], "transformers_route": ["float32"], "unet": ["float32"]}


@pytest.mark.slow
def test_a_bf16_zero3_run_builds_its_module_in_bf16(prepared, sd_model):
    assert built_dtypes(False, "bf16", prepared, sd_model) == {
        "causal_lm": ["bfloat16"], "transformers_route": ["bfloat16"], "unet": ["bfloat16"]}


def test_parameters_in_another_dtype_than_the_precision_are_a_label_mismatch():
    from distlab.configuration.precision import parameter_dtype_mismatch

    assert parameter_dtype_mismatch("fp32", {"float32": 10}, {"float32": 10}) is None
    assert parameter_dtype_mismatch("bf16", {"float32": 4, "bfloat16": 6}, {"float32": 10}) is None
    assert "bfloat16" in parameter_dtype_mismatch("fp32", {"bfloat16": 10}, {"float32": 10})
    assert "masters" in parameter_dtype_mismatch("bf16", {"bfloat16": 10}, {"bfloat16": 10})
    assert "float16" in parameter_dtype_mismatch("bf16", {"float16": 10}, None)
    # QLoRA's packed 4-bit weights are uint8 storage; nowhere else is uint8 a parameter dtype.
    assert parameter_dtype_mismatch("fp32", {"float32": 4, "uint8": 6}, {"float32": 4}, "qlora") is None
    assert "uint8" in parameter_dtype_mismatch("fp32", {"float32": 4, "uint8": 6}, {"float32": 4}, "lora")


def test_verify_fails_a_run_whose_parameters_are_bf16_in_an_fp32_spec():
    import torch

    from distlab.strategies.base import FidelityError, RunContext, Strategy
    from distlab.testing import resolve

    spec = resolve({"strategy": "ddp"})
    strategy = Strategy.__new__(Strategy)
    strategy.ctx, strategy.spec = RunContext(spec=spec, run_dir=".", device=torch.device("cpu")), spec
    strategy.expected_wrappers = ()
    described = {"world_size": spec["world_size"], "wrappers_found": [], "outer_wrapper": "LlamaForCausalLM",
                 "device": "cpu", "parameter_devices": {"cpu": 2}, "parameter_layout": {"plain": 2},
                 "parameter_dtypes": {"bfloat16": 100}, "optimizer_master_dtypes": {"bfloat16": 100}}
    with pytest.raises(FidelityError, match="precision fp32 implies parameters in"):
        strategy.verify(described)
    strategy.verify(dict(described, parameter_dtypes={"float32": 100}, optimizer_master_dtypes={"float32": 100}))

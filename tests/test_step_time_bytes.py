"""The step-time model's bytes per step, held to what one real step of each strategy issues:
every collective of a profiled step (profile: {steps: [s, s]}) as torch.profiler records the
c10d ops, whatever called them (DDP's reducer, DeepSpeed, FSDP2, DTensor, pipeline sends)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import seed_hardware, snakemake, tiny_config

pytestmark = pytest.mark.slow

MACHINE = "testbox"
PROFILED = {"profile": {"steps": [3, 3]}, "steps": 4, "untimed_steps": 2, "eval_every": 0, "grad_accum": 2,
            "micro_batch": 2, "world_size": 2, "tracking": []}
EXPERIMENTS = {
    "ddp": [dict(PROFILED, strategy="ddp")],
    "deepspeed": [dict(PROFILED, strategy="deepspeed", deepspeed={"zero_stage": z}) for z in (1, 2, 3)]
    + [dict(PROFILED, strategy="deepspeed", deepspeed={"zero_stage": 3, "zero3_profile": "lean"})],
    "fsdp": [dict(PROFILED, strategy="fsdp"), dict(PROFILED, strategy="fsdp", fsdp={"reshard_after_forward": False})],
    "parallel": [dict(PROFILED, strategy="tp", grad_accum=1),
                 dict(PROFILED, strategy="pp", micro_batch=4, grad_accum=1,
                      pp={"schedule": "gpipe", "microbatches": 2})],
}
ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}
# Scalars a step also reduces (the item count, the gradient norm): below this, a call is not the model's.
SCALAR_BYTES = 1024


def sent_bytes(trace: Path) -> dict[str, float]:
    """Bytes rank 0 sent per kind of collective in a chrome trace (ring algorithms, 2 ranks: an
    all-reduce of B bytes sends B, an all-gather of B output B/2; gloo's reduce-scatter of B input
    all-reduces it: B)."""
    out: dict[str, float] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") != "X" or not name.startswith("c10d::"):
            continue
        dims, types = event["args"]["Input Dims"], event["args"]["Input type"]

        def nbytes(i):
            if types[i] == "TensorList":
                return sum(math.prod(d) for d in dims[i]) * 4
            return math.prod(dims[i]) * ELEMENT_BYTES[types[i]]
        op = name[len("c10d::"):].strip("_")
        sent = {"allreduce": lambda: nbytes(0), "allgather_base": lambda: nbytes(0) / 2,
                "reduce_scatter_base": lambda: nbytes(1), "send": lambda: nbytes(0)}.get(op, lambda: 0)()
        if sent > SCALAR_BYTES:
            kind = {"allreduce": "all_reduce", "allgather_base": "all_gather", "reduce_scatter_base": "reduce_scatter",
                    "send": "p2p"}[op]
            out[kind] = out.get(kind, 0) + sent
    return out


@pytest.fixture(scope="module")
def profiled_runs(prepared, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("bytes")
    seed_hardware(prepared, work, MACHINE)
    cfg = tiny_config({stage: {"experiments": exps} for stage, exps in EXPERIMENTS.items()}, machine=MACHINE,
                      collectives={"enabled": False})
    from distlab.configuration.config import load

    _, specs = load(cfg, gpu_count=0)
    targets = [f"results/{MACHINE}/{name}/metrics.json" for name in specs]
    snakemake(work, "--cores", "2", *targets, config=cfg, timeout=1500)
    return work / "results" / MACHINE


def test_each_strategys_bytes_per_step_are_what_a_profiled_step_sends(profiled_runs):
    from distlab.records.run_outputs import read_run_record
    from distlab.tools.step_collectives import _wire_factor, collectives_per_step
    from distlab.tools.step_time import model_parts

    config_json = json.loads((profiled_runs.parent / "prep" / "model" / "config.json").read_text())
    checked = []
    for metrics in sorted(profiled_runs.glob("*/metrics.json")):
        spec = read_run_record(metrics).to_dict()["spec"]
        (trace,) = (metrics.parent / "run_files" / "profile").glob("rank0*.json")
        counted = sent_bytes(trace)
        shape, counts, _ = model_parts(spec, config_json)
        predicted: dict[str, float] = {}
        for call in collectives_per_step(spec, shape, counts):
            sent = call["bytes"] * call["calls"] * _wire_factor(call["op"], spec["world_size"], spec["device"])
            predicted[call["op"]] = predicted.get(call["op"], 0) + sent
        assert set(counted) == set(predicted), (spec["id"], counted, predicted)
        for op, sent in counted.items():
            assert predicted[op] == pytest.approx(sent, rel=0.02), (spec["id"], op, counted, predicted)
        checked.append(spec["id"])
    assert len(checked) == sum(map(len, EXPERIMENTS.values())), checked

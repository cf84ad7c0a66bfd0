"""The kit's last lines: the figures a reader wants, read from the results it wrote."""
from __future__ import annotations

import json

from distlab.records.spec import Spec
from distlab.tools import collectives as coll
from distlab.tools.gpu_summary import summary


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_summary_prints_throughput_mfu_memory_oom_validations_and_nccl(tmp_path):
    box = tmp_path / "vm-1xH200"
    write(box / "hardware.json", {"gpus": [{"name": "NVIDIA H200"}]})
    write(box / "ddp-a" / "metrics.json", {
        "experiment": "ddp-a", "status": "ok", "throughput": {"tokens_per_s": 123456.0},
        "flops": {"mfu": 0.412, "peak_flops_per_rank": 989.5e12, "peak_how": "dense bf16 peak of NVIDIA H200"},
        "memory": {"per_rank": [{"cuda_max_allocated_bytes": 3 * 2**30, "cuda_max_reserved_bytes": 4 * 2**30}]},
        "timing": {"comm_inflight_s_per_step": {"median": 0.0021}, "step_time_s": {"median": 0.1}},
        "noise": {"busy": False}, "as_built": {"comm_timing": "CUDA events"},
        "prediction": {"status": "predicted", "step_time_s": 0.12,
                       "terms": {name: {"seconds": s, "how": "x"} for name, s in
                                 {"compute": 0.1, "communication": 0.02, "optimizer": 0.0, "bubble": 0.0}.items()}}})
    write(box / "ddp-a" / "validation.json", {"experiment": "ddp-a", "status": "passed",
                                              "checks": {"reload": {"status": "passed"},
                                                         "reshard": {"status": "unsupported"}}})
    write(box / "ddp-b" / "metrics.json", {"experiment": "ddp-b", "status": "oom", "memory_budget_gib": 2,
                                           "oom": [{"error": "CUDA out of memory. Tried to allocate 64 MiB"}]})
    reason = coll.plan({"world_size": None, "min_bytes": 1, "max_bytes_cpu": 4, "max_bytes_cuda": 4, "factor": 2,
                        "iters": 3, "warmup": 0}, {"a": Spec({"device": "cuda", "world_size": 1})}, 1)["nccl_skipped"]
    write(box / "collectives.json", {"world_size": 2, "nccl": {"status": "skipped", "reason": reason},
                                     "results": coll.skipped_rows(reason)})
    text = "\n".join(summary(tmp_path))
    assert "== vm-1xH200: NVIDIA H200" in text
    assert "ddp-a: 123,456 tokens/s, MFU 41.2% of 989.5 TFLOP/s (dense bf16 peak of NVIDIA H200)" in text
    assert "peak GPU memory 3.00 GiB allocated, 4.00 GiB reserved" in text
    assert "all-reduce in flight 2.10 ms/step (median; CUDA events)" in text
    assert "step time predicted 120.0 ms (compute 100.0, communication 20.0, optimizer 0.0, bubble 0.0 ms), " \
           "measured 100.0 ms: +20%, right" in text
    assert "ddp-b: recorded OOM under a 2 GiB budget: CUDA out of memory" in text
    assert "ddp-a: checkpoint validation passed: reload passed, reshard unsupported" in text
    assert "NCCL bandwidth: not measured: NCCL collectives need at least 2 GPUs" in text


def test_summary_says_what_is_missing_when_the_kit_stopped_early(tmp_path):
    (tmp_path / "vm").mkdir()
    write(tmp_path / "vm" / "hardware.json", {"gpus": []})
    text = "\n".join(summary(tmp_path))
    assert "checkpoint validation: none finished" in text and "the collectives rule did not finish" in text
    assert "did not get far enough" in summary(tmp_path / "vm")[0]
    lines = summary(tmp_path / "vm", {"experiments": ["a", "b"], "validated": [], "budgeted": []})
    assert lines[-1] == "FAILED (2, none ran): a, b"


def test_measured_nccl_prints_the_best_bus_bandwidth_per_op(tmp_path):
    from distlab.tools.gpu_summary import nccl_lines

    rows = [{"backend": "nccl", "op": "all_reduce", "status": "ok", "size_bytes": s, "busbw_bytes_per_s": b,
             "algbw_bytes_per_s": b / 2} for s, b in [(1 << 20, 50e9), (1 << 29, 300e9)]]
    (line,) = nccl_lines({"world_size": 2, "nccl": {"status": "measured"}, "results": rows}, tmp_path)
    assert line == "NCCL all_reduce over 2 GPUs: busbw 300.0 GB/s at 512 MiB (algbw 150.0 GB/s)"


def test_every_planned_run_is_listed_with_its_status_and_failures_exit_non_zero_naming_them(tmp_path, capsys):
    """The kit's own plan (config/gpu_check.yaml on one GPU): a run that crashed before writing
    metrics.json and an unfinished validation are named, not dropped, and the exit status is 1."""
    from conftest import REPO
    from distlab.tools.gpu_summary import main, planned

    kit = str(REPO / "config" / "gpu_check.yaml")
    plan = planned([kit], gpus=1)
    assert len(plan["experiments"]) == 4 and plan["budgeted"] and plan["validated"]
    box = tmp_path / "vm-1xH200"
    write(box / "hardware.json", {"gpus": [{"name": "NVIDIA H200"}]})
    crashed = plan["validated"][0]
    others = [name for name in plan["experiments"] if name not in plan["budgeted"] and name != crashed]
    for name in others:
        write(box / name / "metrics.json", {"experiment": name, "status": "ok", "throughput": {"tokens_per_s": 1.0}})
    for name in plan["validated"]:
        if name != crashed:
            write(box / name / "validation.json", {"experiment": name, "status": "passed", "checks": {}})
    (budgeted,) = plan["budgeted"]
    write(box / budgeted / "metrics.json", {"experiment": budgeted, "status": "oom", "memory_budget_gib": 2,
                                           "oom": [{"error": "CUDA out of memory"}]})
    assert main([str(tmp_path), "--configfile", kit, "--gpus", "1"]) == 1
    out = capsys.readouterr().out
    assert f"{crashed}: FAILED: no metrics.json: the run crashed or never started" in out
    assert f"{crashed}: checkpoint validation FAILED: no validation.json" in out
    assert f"{budgeted}: recorded OOM under a 2 GiB budget" in out  # the budget run's lesson, not a failure
    assert out.strip().splitlines()[-1] == f"FAILED (2): {crashed}, {crashed} (validation)"
    for name in others:
        assert f"{name}: 1 tokens/s" in out


def test_a_trained_run_whose_save_failed_counts_as_failed(tmp_path):
    from distlab.tools.gpu_summary import summarize

    write(tmp_path / "box" / "hardware.json", {"gpus": []})
    write(tmp_path / "box" / "a" / "metrics.json", {"experiment": "a", "status": "ok",
                                                   "checkpoint": {"status": "failed", "error": "disk full"}})
    lines, failed = summarize(tmp_path, {"experiments": ["a"], "validated": [], "budgeted": []})
    assert failed == ["a"] and any("trained, but its checkpoint save failed: disk full" in line for line in lines)


def test_a_budget_run_that_fit_its_budget_is_a_note_not_a_failure(tmp_path):
    from distlab.tools.gpu_summary import summarize

    write(tmp_path / "box" / "hardware.json", {"gpus": []})
    write(tmp_path / "box" / "b" / "metrics.json", {"experiment": "b", "status": "ok",
                                                   "spec": {"memory_budget_gib": 2}})
    lines, failed = summarize(tmp_path, {"experiments": ["b"], "validated": [], "budgeted": ["b"]})
    assert failed == [] and "    note: it did not run out of memory under its 2 GiB budget" in lines

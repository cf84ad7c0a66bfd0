"""Spec `launches`: independent launches of one experiment (fresh processes each), so the
report's spread is run-to-run variance, not the windows of one process."""
from pathlib import Path

import pytest

from conftest import resolve, run_experiment


@pytest.mark.slow
def test_further_launches_time_the_same_work_and_give_the_spread(prepared, tmp_path):
    from distlab.report.cards import spread_caveat
    from distlab.report.collect import throughput_stats

    run = run_experiment(prepared, tmp_path / "run", resolve({"world_size": 1, "micro_batch": 4, "launches": 2},
                                                             steps=4, untimed_steps=2), checkpoint=False)
    first, second = run["launches"]
    assert first["tokens_per_s"] == run["throughput"]["tokens_per_s"]
    assert second["loss_last"] == pytest.approx(first["loss_last"], abs=1e-6)  # the same work, again
    assert second["noise"]["window_s"] > 0  # its own timed steps, its own machine record
    assert not list(tmp_path.joinpath("run").glob("launch-*"))  # folded into metrics.json, folders gone
    from card_runs import fake_run, report_run
    from distlab.records.run_outputs import read_run_record

    stats = throughput_stats(read_run_record(tmp_path / "run" / "metrics.json"))  # no steps.jsonl read
    assert stats.launches == 2 and stats.low == min(first["tokens_per_s"], second["tokens_per_s"])
    launched, once = report_run(tmp_path / "run"), fake_run(tmp_path / "once", {"world_size": 1, "micro_batch": 4})
    assert "separate launches" in spread_caveat([launched]) and "not measured" in spread_caveat([launched, once])


def image_run(run_dir, spec, images_per_s: float) -> None:
    """A text-to-image run's metrics.json as distlab.rank.run_summary writes one: its throughput
    counted in its task's unit (images), no tokens figure anywhere."""
    from card_runs import fake_run
    from distlab.records.run_outputs import read_run_record, write_metrics

    fake_run(run_dir, {key: spec[key] for key in ("task", "method", "launches")})
    record = read_run_record(run_dir / "metrics.json").to_dict()
    images_per_step = spec["micro_batch"] * spec["grad_accum"] * spec["world_size"]
    record["throughput"] = {"unit": "image", "images_per_s": images_per_s, "images_per_step": images_per_step,
                            "images_per_s_per_rank": images_per_s / spec["world_size"],
                            "samples_per_step": images_per_step, "samples_per_s": images_per_s}
    record["flops"] = {"flops_per_image": 1e9, "mfu": None}
    record["versions"] = {"torch": "2.13.0", "diffusers": "0.36.0"}
    write_metrics(run_dir, record)


def test_a_text_to_image_run_of_two_launches_is_folded_and_summarised_in_images_per_s(tmp_path):
    """Further launches and the summary read the unit the run measured in (images/s for
    text-to-image), never a tokens/s it does not have."""
    from distlab.records.job import Job
    from distlab.jobs.launches import repeat_launches
    from distlab.report.collect import load_checked_runs
    from distlab.report.summary_table import summary_frame

    spec = resolve({"task": "text-to-image", "method": "lora", "launches": 2})
    run_dir = tmp_path / "results" / "testbox" / spec["id"]
    image_run(run_dir, spec, images_per_s=10.0)

    def second_launch(job, job_path, log_path, timeout):  # the launcher's part: the same work, timed again
        image_run(Path(job.run_dir), job.spec, images_per_s=8.0)

    launches = repeat_launches(Job(spec=spec, run_dir=str(run_dir)), second_launch, None, None)
    assert [(x["unit"], x["images_per_s"]) for x in launches] == [("image", 10.0), ("image", 8.0)]
    runs, rejected = load_checked_runs([str(run_dir / "metrics.json")])
    assert rejected == []
    (run,) = runs
    assert run.throughput_spread.launches == 2 and "images/s" in run.throughput_spread.how
    (row,) = summary_frame([run]).to_dict("records")
    assert row["unit"] == "image"
    assert (row["images_per_s"], row["images_per_s_low"], row["images_per_s_high"]) == (10.0, 8.0, 10.0)
    assert row["tokens_per_s"] is None and row["tokens_per_s_low"] is None

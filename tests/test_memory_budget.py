"""The per-rank memory budget is real on CPU: a run past it ends as `oom`, one under it
finishes, and every run records its load-phase and training-phase peaks."""
import pytest

from conftest import resolve, run_experiment
from distlab.records.job import Job
from distlab.records.run_outputs import read_run_record

MIB = 2**20


@pytest.mark.slow
def test_a_cpu_run_past_its_budget_ends_as_oom_and_one_within_it_finishes(prepared, tmp_path):
    from distlab.jobs.launch import launch

    # 0.25 GiB: less than the interpreter + torch + transformers of one rank process.
    spec = resolve({"strategy": "ddp", "world_size": 1, "memory_budget_gib": 0.25}, steps=2, untimed_steps=1)
    job = Job(spec=spec, run_dir=str(tmp_path / "small"), data_dir=str(prepared / "data32"),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=[], checkpoint_dir=None)
    assert launch(job, log_path=str(tmp_path / "small.log"), timeout=300) == "oom"
    metrics = read_run_record(tmp_path / "small" / "metrics.json").to_dict()
    assert metrics["status"] == "oom"
    (record,) = metrics["oom"]
    assert "passed the memory budget 0.250 GiB" in record["error"]

    roomy = resolve({"strategy": "ddp", "world_size": 1, "memory_budget_gib": 4}, steps=2, untimed_steps=1)
    ok = run_experiment(prepared, tmp_path / "roomy", roomy, checkpoint=False)
    assert ok["status"] == "ok"
    (rank,) = ok["memory"]["per_rank"]
    assert rank["budget"]["enforced"] and rank["budget"]["fits"]
    load, training = rank["load_phase"]["rss_peak_bytes"], rank["training_phase"]["rss_peak_bytes"]
    # torch + transformers are imported before the first step: hundreds of MB, then training on top.
    assert load > 200 * MIB and training > 0
    assert rank["load_phase"]["reset_for_training"]


def test_the_budget_verdict_covers_the_final_save_and_export():
    """The export runs after the training peak is recorded: its peak joins the verdict, so a
    rank that fit through training but not through the save is not reported as fitting."""
    from distlab.runtime.memory import with_peaks_through_save

    verdict = {"bytes": 100, "enforced": False, "measured_bytes": 90, "measured_what": "peak RSS", "fits": True}
    memory = {"per_rank": [{"budget": dict(verdict), "training_phase": {"rss_peak_bytes": 90}},
                           {"budget": dict(verdict), "training_phase": {"rss_peak_bytes": 90}}]}
    through_save = with_peaks_through_save(memory, [{"rss_peak_bytes": 95}, {"rss_peak_bytes": 120}])
    assert memory["per_rank"][1]["budget"] == verdict  # the record before the save is left as it was
    memory = through_save
    first, second = (record["budget"] for record in memory["per_rank"])
    assert first["fits"] and first["measured_bytes"] == 95
    assert not second["fits"] and second["measured_bytes"] == 120
    assert second["measured_what"].endswith("through the final save and export")
    assert memory["per_rank"][1]["peak_through_save_bytes"] == 120


def test_the_fsdp_card_shows_every_ranks_load_training_and_save_peaks(tmp_path):
    """Stage 4's card has one row per rank with its own three phase peaks (a CUDA run's from
    torch.cuda.max_memory_reserved), not only the largest rank's."""
    from card_runs import changed, fake_run
    from distlab.report.cards import stage4_fsdp

    run = fake_run(tmp_path / "fsdp", {"strategy": "fsdp", "world_size": 2, "micro_batch": 2}, "fsdp",
                   as_built={"wrappers_found": ["FSDPModule"]})
    peaks = [(300, 500, 520), (310, 480, 470)]  # MiB: load, training, save on rank 0 and rank 1
    per_rank = [{**record, "load_phase": {"rss_peak_bytes": load * MIB},
                 "training_phase": {"rss_peak_bytes": train * MIB}, "save_phase": {"rss_peak_bytes": save * MIB}}
                for record, (load, train, save) in zip(run.memory.per_rank, peaks)]
    per_rank[1]["save_phase"]["cuda_max_reserved_bytes"] = 90 * MIB
    run = changed(run, memory={**run.memory, "per_rank": per_rank})
    (table,) = [t for t in stage4_fsdp.build([run]).tables if t.title.startswith("Per-rank peak memory")]
    rows = table.frame.to_dict("records")
    assert [(r["rank"], r["load peak (MiB)"], r["training peak (MiB)"], r["save peak (MiB)"]) for r in rows] == \
        [(0, 300, 500, 520), (1, 310, 480, 90)]

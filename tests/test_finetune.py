"""Fine-tuning promises on real 2-rank runs: activation checkpointing leaves the losses alone
and holds fewer activations (as the advisor estimates), every step records the schedule's
learning rate and the pre-clip gradient norm, the trackers hold the same curves as
steps.jsonl, the job log shows progress and eval points, and the fine-tuning card is built
from those measurements. Two runs of the session's DDP baseline shape (tests/test_fsdp.py),
one of which also carries the trackers, the eval points and the progress lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import resolve, run_experiment
from test_fsdp import DDP_SHAPE, DEFAULTS, ddp_baseline

EVAL_EVERY = 5


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    out = {"none": dict(ddp_baseline(prepared), _dir=str(prepared / "ddp-baseline"))}
    extra = {"full": {"tracking": ["tensorboard", "mlflow"], "eval_every": EVAL_EVERY, "progress_every_s": 1e-6},
             "selective": {}}
    for mode, more in extra.items():
        spec = resolve({"strategy": "ddp", **DDP_SHAPE, "activation_checkpointing": mode, "tag": mode, **more},
                       **DEFAULTS)
        out[mode] = dict(run_experiment(prepared, root / mode, spec, checkpoint=False), _dir=str(root / mode))
    return out


def steps_of(run) -> list[dict]:
    return [json.loads(line) for line in (Path(run["_dir"]) / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_losses_and_holds_fewer_activations(runs):
    none = runs["none"]
    for mode, checkpointed in (("full", [0, 1]), ("selective", [0])):
        run = runs[mode]
        assert run["as_built"]["activation_checkpointing"]["checkpointed"] == checkpointed
        worst = max(abs(a - b) for a, b in zip(run["loss"]["per_step"], none["loss"]["per_step"]))
        assert worst <= 1e-6, (mode, worst)
    saved = {mode: [m["activations"]["bytes"] for m in run["memory"]["per_rank"]] for mode, run in runs.items()}
    for rank in range(2):
        assert saved["full"][rank] < saved["selective"][rank] < saved["none"][rank], saved


@pytest.mark.slow
def test_the_advisor_estimates_the_saved_activations_of_every_mode(prepared, runs):
    from distlab.tools import advisor, advisor_check

    shape = advisor.model_shape(json.loads((prepared / "model" / "config.json").read_text()))
    rows = advisor_check.check_against_runs({"model": {"shape": shape}},
                                      [dict(run, machine="testbox", experiment=mode) for mode, run in runs.items()])
    assert len(rows) == 3
    for row in rows:
        assert abs(row["activations measured/estimated"] - 1) < 0.05, row


@pytest.mark.slow
def test_every_step_records_the_schedules_learning_rate_and_the_pre_clip_norm(runs):
    from distlab.runtime.schedule import expected_rates

    run = runs["none"]
    rows = steps_of(run)
    assert [r["lr"] for r in rows] == expected_rates(run["spec"]) == run["optimization"]["lr_per_step"]
    assert rows[0]["lr"] == 0.0 and rows[3]["lr"] == run["spec"]["lr"] and rows[-1]["lr"] < rows[4]["lr"]
    norms = [r["grad_norm"] for r in rows]
    assert all(n > 0 for n in norms) and max(norms) > run["spec"]["max_grad_norm"]


@pytest.mark.slow
def test_trackers_hold_the_curves_steps_jsonl_holds(runs):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs["full"]
    rows = steps_of(run)
    tokens = run["throughput"]["tokens_per_step"]
    expected = {"train/loss": [r["loss"] for r in rows], "train/lr": [r["lr"] for r in rows],
                "train/grad_norm": [r["grad_norm"] for r in rows],
                "train/tokens_per_s": [tokens / r["step_time_s"] for r in rows],
                "train/memory_bytes": [r["memory_bytes"] for r in rows],
                "eval/loss": [r["eval_loss"] for r in rows if r["eval_loss"] is not None]}
    assert len(expected["eval/loss"]) == DEFAULTS["steps"] // EVAL_EVERY
    where = run["tracking"]
    events = EventAccumulator(where["tensorboard"], size_guidance={"scalars": 0})
    events.Reload()
    client = MlflowClient(tracking_uri=where["mlflow"]["tracking_uri"])
    for key, values in expected.items():
        board = [e.value for e in events.Scalars(key)]
        logged = [m.value for m in sorted(client.get_metric_history(where["mlflow"]["run_id"], key),
                                          key=lambda m: m.step)]
        assert board == pytest.approx(values, rel=1e-6), key  # TensorBoard stores float32
        assert logged == pytest.approx(values, rel=1e-12), key
    mlflow_run = client.get_run(where["mlflow"]["run_id"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == run["experiment"]
    params = mlflow_run.data.params
    assert params["lr_schedule"] == "cosine" and params["activation_checkpointing"] == "full"
    assert params["deepspeed.zero_stage"] == "2" and params["steps"] == str(DEFAULTS["steps"])


@pytest.mark.slow
def test_progress_and_eval_points_reach_the_job_log_and_the_last_is_the_final_eval(runs):
    import re

    run = runs["full"]
    log = (Path(run["_dir"]) / "train.log").read_text()
    progress = re.findall(r"progress: step (\d+)/20 \(\d+%\) loss [\d.]+ lr \S+ grad_norm \S+ tokens/s [\d,]+ "
                          r"elapsed \d+:\d\d:\d\d ETA \d+:\d\d:\d\d", log)
    assert progress and progress[-1] == "20", log[-2000:]
    points = run["eval"]["during_training"]
    assert [p["steps_done"] for p in points] == [5, 10, 15, 20]
    assert len(re.findall(r"eval: after \d+ steps held-out loss", log)) == 4
    # The eval point after the last step is the final eval: one pass, not two, over the same
    # tokens, and the final eval says which point it is.
    assert points[-1]["loss"] == run["eval"]["trained"]["loss"]
    assert "(the eval point after step 20, the last)" in run["eval"]["trained"]["how"]
    assert points[0]["loss"] > points[-1]["loss"]


@pytest.mark.slow
def test_fine_tuning_card_is_computed_from_the_runs(runs):

    from distlab.report.cards import FAILED, PASSED
    from distlab.report.cards.stage7_finetune import GOAL_AC, GOAL_EVAL, GOAL_SCHEDULE, build

    from card_runs import changed, report_run

    listed = [changed(report_run(run["_dir"]), machine="testbox") for run in runs.values()]
    goals = {g.text: g for g in build(listed).goals}
    assert goals[GOAL_AC].status == PASSED and goals[GOAL_SCHEDULE].status == PASSED
    assert goals[GOAL_EVAL].status == PASSED
    table = build(listed).tables[0].frame
    assert list(table["mode"]) == ["none", "selective", "full"]
    # A checkpointed run whose loss moved fails the goal.
    per_step = list(listed[1].loss.per_step)
    per_step[5] += 1e-3
    moved = [listed[0], changed(listed[1], loss={**listed[1].loss, "per_step": per_step}), *listed[2:]]
    assert {g.text: g for g in build(moved).goals}[GOAL_AC].status == FAILED

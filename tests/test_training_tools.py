"""Regional compilation and profiler traces: a compiled run trains the same model as the eager
one with its compile time recorded apart, and a profile leaves a trace a user opens in Perfetto."""
import json

import pytest

from conftest import resolve, run_experiment
from distlab.report.cards import FAILED, PASSED
from distlab.report.cards.finetune_tools import GOAL_COMPILE, GOAL_PROFILE

SHORT = {"steps": 3, "untimed_steps": 1}


def card_goal(runs, text):
    from distlab.report.cards.stage7_finetune import build

    return {g.text: g for g in build(runs).goals}[text]


def test_compile_is_refused_where_it_is_not_run_naming_why():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"experiments\[0\]\.compile': compile under strategy deepspeed with "
                                          r"zero_stage 3: .*graph breaks"):
        resolve({"strategy": "deepspeed", "world_size": 2, "deepspeed": {"zero_stage": 3}, "compile": True})
    assert resolve({"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}, "compile": True})["compile"]
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.untimed_steps': compile: true compiles"):
        resolve({"compile": True, "untimed_steps": 0})


def test_a_profile_window_past_the_last_step_is_refused():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"experiments\[0\]\.profile\.steps': step 3 is past the run's last step"):
        resolve({**SHORT, "profile": {"steps": [1, 3]}})


@pytest.mark.slow
def test_compiled_layers_train_the_same_losses_with_compile_time_recorded_apart(prepared, tmp_path):
    eager = run_experiment(prepared, tmp_path / "eager", resolve(SHORT), checkpoint=False)
    spec = resolve({**SHORT, "compile": True})
    assert spec["id"] == "ddp-full-w1-mb4-ga1-compiled"
    compiled = run_experiment(prepared, tmp_path / "compiled", spec, checkpoint=False)
    assert compiled["as_built"]["compiled"]["compiled_layers_found"] == 2  # the tiny model's decoder layers
    timing = compiled["timing"]["compile"]
    assert timing["dynamo"]["frames_compiled"] > 0
    assert timing["first_step_s"] > timing["steady_step_s_median"] and timing["compile_s"] > 0
    for a, b in zip(eager["loss"]["per_step"], compiled["loss"]["per_step"], strict=True):
        assert abs(a - b) <= 1e-4, (eager["loss"]["per_step"], compiled["loss"]["per_step"])
    # The fine-tuning card pairs the two: speed-up and compile time shown, a moved loss fails it.
    from card_runs import changed, report_run

    listed = [changed(report_run(tmp_path / name), machine="testbox") for name in ("eager", "compiled")]
    goal = card_goal(listed, GOAL_COMPILE)
    assert goal.status == PASSED and "1 beside an eager twin" in goal.evidence
    moved = list(listed[1].loss.per_step)
    moved[2] += 1e-3
    assert card_goal([listed[0], changed(listed[1], loss={**listed[1].loss, "per_step": moved})],
                     GOAL_COMPILE).status == FAILED


@pytest.mark.slow
def test_a_profile_writes_a_chrome_trace_of_the_chosen_steps_per_rank(prepared, tmp_path):
    run = run_experiment(prepared, tmp_path / "run", resolve({**SHORT, "world_size": 2, "profile": {"steps": [1, 2]}}),
                         checkpoint=False)
    profile = run["profile"]
    assert profile["profiled_steps"] == [1, 2]
    assert profile["traces"] == ["run_files/profile/rank0.pt.trace.json", "run_files/profile/rank1.pt.trace.json"]
    for trace in profile["traces"]:
        events = json.loads((tmp_path / "run" / trace).read_text())["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("step ")}
        assert steps == {"step 1", "step 2"}
    assert profile["memory_snapshots"] == [None, None] and "no memory snapshot" in profile["memory_snapshot_note"]
    assert "no memory snapshot" in (tmp_path / "run" / "train.log").read_text()
    from card_runs import changed, report_run

    goal = card_goal([changed(report_run(tmp_path / "run"), machine="testbox")], GOAL_PROFILE)
    assert goal.status == PASSED and goal.links == [str(tmp_path / "run" / t) for t in profile["traces"]]

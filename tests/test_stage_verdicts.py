"""A stage is not passed while one of its runs missed loss parity with its DDP twin or failed its
checkpoint validation, and the report's overview says so first."""
from __future__ import annotations

import copy

from card_runs import from_metrics
from distlab.report.cards import FAILED, NOT_RUN, PASSED, Card, Goal
from distlab.report.cards.parity import GOAL_LESSON, lesson_goal
from distlab.records.spec import Spec


def run(experiment: str, stage: str, strategy: str, losses: list[float], validation: dict | None = None):
    return from_metrics({"experiment": experiment, "stage": stage, "machine": "box", "status": "ok",
                         "spec": Spec({"strategy": strategy, "sampler": "distributed", "seed": 0, "dataset": "default",
                                       "seq_len": 32, "precision": "fp32", "lr": 1e-3, "weight_decay": 0.0,
                                       "method": "full", "steps": 4}),
                         "throughput": {"samples_per_step": 8}, "parameters": {"total": 100},
                         "loss": {"per_step": losses}}, validation=validation)


DDP = run("ddp-w2", "ddp", "ddp", [5.0, 4.0, 3.0])
PASS = {"passed": True}


def test_a_zero_run_off_ddp_by_more_than_the_tolerance_fails_its_stage_naming_the_gap():
    z3 = run("z3", "deepspeed", "deepspeed", [5.0, 4.0005, 3.0004], PASS)
    goal = lesson_goal("deepspeed", [DDP, z3], compare_with_ddp=True)
    assert goal.status == FAILED and "z3 vs ddp-w2 by 5.00e-04" in goal.evidence


def test_a_failed_checkpoint_validation_fails_its_stage_even_at_parity():
    z3 = run("z3", "deepspeed", "deepspeed", [5.0, 4.0, 3.0], {"passed": False, "reason": "export failed"})
    goal = lesson_goal("deepspeed", [DDP, z3], compare_with_ddp=True)
    assert goal.status == FAILED and "z3 (export failed)" in goal.evidence


def test_a_stage_at_parity_with_passed_validations_passes_and_one_with_neither_is_not_run():
    z2 = run("z2", "deepspeed", "deepspeed", [5.0, 4.000001, 3.0], PASS)
    assert lesson_goal("deepspeed", [DDP, z2], compare_with_ddp=True).status == PASSED
    assert lesson_goal("fsdp", [DDP, z2], compare_with_ddp=True).status == NOT_RUN
    # Stage 1 compares no run with DDP (its no-sampler run trains other samples by design).
    off = run("ddp-nosampler", "ddp", "ddp", [5.0, 4.5, 3.5], PASS)
    assert lesson_goal("ddp", [DDP, off], compare_with_ddp=False).status == PASSED


def test_the_overview_says_first_which_stage_did_not_teach_its_lesson():
    from distlab.report.build import overview_card

    z3 = run("z3", "deepspeed", "deepspeed", [5.0, 4.0005, 3.0004], PASS)
    card = Card(3, "Stage 3 - DeepSpeed ZeRO", goals=[lesson_goal("deepspeed", [DDP, z3], True),
                                                       Goal("minimal", "table", PASSED)])
    overview = overview_card([card], [], {})
    assert overview.notes[0].startswith("NOT SOUND: Stage 3 - DeepSpeed ZeRO: loss differs from DDP")
    row = overview.tables[0].frame.iloc[0]
    assert row["minimal"] == FAILED
    sound = copy.deepcopy(card)
    sound.goals[0] = lesson_goal("deepspeed", [DDP, run("z3", "deepspeed", "deepspeed", [5.0, 4.0, 3.0], PASS)], True)
    assert not overview_card([sound], [], {}).notes[0].startswith("NOT SOUND")
    assert GOAL_LESSON == sound.goals[0].text

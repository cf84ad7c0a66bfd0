"""Every figure and sentence a card prints is computed from the runs it describes, and a
goal's status says what was checked (passed / failed / not run / compared, not enforced)."""
from __future__ import annotations

from card_runs import beside, changed, fake_run, timed
from distlab.records.spec import Spec


def test_a_comm_time_that_was_not_measured_prints_as_not_measured_never_zero(tmp_path):
    from distlab.report.cards import stage1_ddp

    one = fake_run(tmp_path / "a", {"world_size": 1, "micro_batch": 8}, comm_median_s=0.0)
    two = fake_run(tmp_path / "b", {"world_size": 2, "micro_batch": 4}, comm_median_s=None)
    (table,) = [t for t in stage1_ddp.build([one, two]).tables]
    cells = list(table.frame["all-reduce in flight (ms/step)"])
    assert cells == [0.0, "not measured"]


def test_fsdp_through_accelerate_reports_no_comm_time_rather_than_zero():
    from distlab.strategies.accelerate import AccelerateStrategy
    from distlab.strategies.base import RunContext

    strategy = AccelerateStrategy.__new__(AccelerateStrategy)
    context = RunContext(spec=Spec({}), run_dir="", device=None, world_size=2)
    strategy.ctx, strategy.hook, strategy.fsdp = context, None, True
    assert strategy.take_comm_seconds() is None and strategy.comm_unmeasured_reason


def _budget(fits: bool, enforced: bool, measured_mib: float) -> dict:
    return {"fits": fits, "enforced": enforced, "bytes": 64 * 2**20, "measured_bytes": measured_mib * 2**20,
            "measured_what": "model state"}


def _zero_pair(tmp_path, enforced: bool):
    over = {"strategy": "deepspeed", "memory_budget_gib": 0.0625, "micro_batch": 2}
    one = fake_run(tmp_path / "one", {**over, "world_size": 1, "deepspeed": {"zero_stage": 0}}, "deepspeed",
                   budget=_budget(False, enforced, 80))
    three = fake_run(tmp_path / "three", {**over, "world_size": 2, "deepspeed": {"zero_stage": 3}}, "deepspeed",
                     budget=_budget(True, enforced, 40))
    return [one, three]


def test_a_memory_budget_only_compared_after_the_run_does_not_pass_the_zero3_goal(tmp_path):
    from distlab.report.cards import COMPARED, PASSED
    from distlab.report.cards.stage3_deepspeed import budget_goal

    compared = budget_goal(_zero_pair(tmp_path, enforced=False))
    assert compared.status == COMPARED and "not enforced" in compared.evidence
    assert budget_goal(_zero_pair(tmp_path, enforced=True)).status == PASSED


def test_the_loss_parity_sentence_follows_the_measured_gap(tmp_path):
    from distlab.report.cards.stage3_deepspeed import parity_note

    row = {"DeepSpeed run": "deepspeed-z3", "DDP run": "ddp-w2", "steps compared": 20, "precision": "fp32"}
    close = parity_note([dict(row, **{"max |loss diff|": "2.0e-06"})])
    far = parity_note([dict(row, **{"max |loss diff|": "3.0e-03"})])
    assert "2.0e-06" in close and "unchanged" in close
    assert "3.0e-03" in far and "unchanged" not in far and "NOT reproduce" in far
    assert "earlier trial" not in close + far  # no anecdote: only what these runs measured


def test_zero_is_compared_only_with_a_ddp_run_that_trained_the_same_way(tmp_path):
    """A DDP run with a cosine schedule and clipping is no twin for a constant-LR ZeRO run: its
    loss gap would be the recipe's (the default report once said 'DeepSpeed did NOT reproduce DDP')."""
    from card_runs import fake_run
    from distlab.report.cards.stage3_deepspeed import ddp_parity

    zero = fake_run(tmp_path / "z", {"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
                                     "deepspeed": {"zero_stage": 3}}, "deepspeed",
                    as_built={"deepspeed": {"basic_optimizer": "AdamW"}})
    same = fake_run(tmp_path / "d", {"strategy": "ddp", "world_size": 2, "micro_batch": 4})
    cosine = fake_run(tmp_path / "c", {"strategy": "ddp", "world_size": 2, "micro_batch": 4, "lr_schedule": "cosine",
                                       "lr_warmup_steps": 2, "max_grad_norm": 1.0}, losses=(3.0, 2.9, 2.8))
    assert [r["DDP run"] for r in ddp_parity([zero], [cosine, same])] == [same.experiment]
    assert ddp_parity([zero], [cosine]) == []


def test_fsdp_and_tensor_parallel_losses_are_set_beside_ddp_only_when_the_recipe_and_model_match(tmp_path):
    """One rule (report/cards/parity.py) picks the DDP twin for stages 3, 4 and 6: a run on another
    model or recipe is no twin, so its gap is never reported as the strategy's."""
    from card_runs import fake_run
    from distlab.report.cards.parity import ddp_twin, gap_sentence, parity_rows

    recipe = {"lr_schedule": "cosine", "lr_warmup_steps": 2, "max_grad_norm": 1.0}
    fsdp = fake_run(tmp_path / "f", {"strategy": "fsdp", "world_size": 2, "micro_batch": 2, "grad_accum": 2, **recipe},
                    "fsdp", losses=(3.0, 2.5000004, 2.0))
    tp = fake_run(tmp_path / "t", {"strategy": "tp", "world_size": 2, "micro_batch": 8, **recipe}, "parallel")
    tp = changed(tp, throughput={**tp.throughput, "samples_per_step": 8})  # every TP rank sees the whole batch
    ddp = fake_run(tmp_path / "d", {"strategy": "ddp", "world_size": 2, "micro_batch": 4, **recipe})
    bigger = changed(fake_run(tmp_path / "b", {"strategy": "ddp", "world_size": 2, "micro_batch": 4, **recipe}),
                     parameters={"total": 2000, "trainable": 2000})
    rows = parity_rows([fsdp], [bigger, ddp, fsdp], "FSDP run")
    assert [(r["DDP run"], r["steps compared"]) for r in rows] == [(ddp.experiment, 3)]
    assert abs(float(rows[0]["max |loss diff|"]) - 4e-7) < 1e-8
    assert "FSDP sharding left fp32 training unchanged" in gap_sentence(rows, "FSDP run", "FSDP sharding", "FSDP")
    assert ddp_twin(tp, [bigger]) is None and ddp_twin(tp, [bigger, ddp]) is ddp
    constant = fake_run(tmp_path / "c", {"strategy": "fsdp", "world_size": 2, "micro_batch": 2, "grad_accum": 2},
                        "fsdp")
    assert parity_rows([constant], [ddp], "FSDP run") == []


def test_a_checkpoint_goal_names_only_the_checks_every_checkpoint_passed(tmp_path):
    from distlab.report.cards.checkpoint_table import checkpoint_card

    run = fake_run(tmp_path / "run", {"world_size": 2, "micro_batch": 4})
    checks = {"reload": {"status": "passed", "max_abs_logit_diff": 0.0},
              "reshard": {"status": "unsupported", "reason": "cannot load at 1 rank"},
              "resume_parity": {"status": "passed", "max_abs_loss_diff": 0.0, "steps_resumed": 3},
              "export": {"status": "passed"}, "size_and_time": {}}
    run = beside(run, validation={"passed": True, "status": "passed", "checks": checks})  # collect.load_run's field
    (goal,) = checkpoint_card([run]).goals
    assert goal.status == "passed" and "reshard" not in goal.text
    assert "reload" in goal.text and "reshard: " in goal.evidence and "unsupported" in goal.evidence


def test_a_thin_foreign_validation_file_is_shown_unreadable_and_named_not_a_crash(tmp_path):
    """A validation.json that matches the results schema but whose passed checks lack the
    figures distlab writes (another tool's, an older one's): its cells read 'unreadable', the
    card names the file, and its 'passed' does not turn the goal green."""
    from card_runs import fake_run
    from distlab.report.cards.checkpoint_table import UNREADABLE, checkpoint_card

    run = fake_run(tmp_path / "run", {"world_size": 2, "micro_batch": 4})
    run = beside(run, validation={"schema_version": 1, "passed": True, "status": "passed",
                                  "checks": {"reload": {"status": "passed"}, "resume_parity": {"status": "passed"}}})
    card = checkpoint_card([run])
    (table,) = card.tables
    assert table.frame["reload max |dlogit|"].tolist() == [UNREADABLE]
    assert table.frame["resume max |dloss|"].tolist() == [UNREADABLE]
    named = [note for note in card.notes if str(tmp_path / "run" / "validation.json") in note]
    assert named and "max_abs_logit_diff" in named[0]
    (goal,) = card.goals
    assert goal.status == "failed" and "validation.json" in goal.evidence


def test_fsdp_through_accelerate_is_on_the_stage4_card_and_does_not_turn_it_red(tmp_path):
    from distlab.report.cards import stage4_fsdp

    run = fake_run(tmp_path / "acc", {"strategy": "fsdp", "world_size": 2, "micro_batch": 2}, "fsdp",
                   comm_median_s=None, as_built={"wrappers_found": ["FSDPModule (fully_shard)"], "device": "cuda:0",
                                               "outer_wrapper": "FSDPLlamaForCausalLM",
                                               "accelerate": {"fsdp_sharded_modules": 3}})
    # A GPU path: config refuses it on CPU.
    run = changed(run, spec=run.spec.replace(fsdp=dict(run.spec.fsdp, via="accelerate"), device="cuda"))
    card = stage4_fsdp.build([run])
    assert card.goals[0].status != "failed" and run.experiment in card.goals[0].evidence
    (variants,) = [t for t in card.tables if t.title == "FSDP variants"]
    assert list(variants.frame["experiment"]) == [run.experiment]
    assert any("not measured" in n for n in card.notes)


def test_no_clear_winner_says_its_spread_is_one_process_not_independent_repeats(tmp_path):
    from distlab.report.build import ranking_card

    runs = [timed(changed(fake_run(tmp_path / str(w), {"world_size": w, "micro_batch": 8 // w, "repeats": 2}),
                          versions={"torch": "x"}), [{"step_time_s": 0.1, "untimed": False}] * 4) for w in (1, 2)]
    (table,) = ranking_card(runs).tables
    assert "within one process" in table.how and "run-to-run variance across separate launches was not " \
        "measured" in table.how


def test_the_ranking_gives_each_runs_own_number_of_timed_steps(tmp_path):
    """Runs timed over different step counts: the caption does not quote one run's count for all."""
    from distlab.report.build import ranking_card

    runs = [timed(changed(fake_run(tmp_path / str(w), {"world_size": w, "micro_batch": 8 // w}),
                          versions={"torch": "x"}), [{"step_time_s": 0.1, "untimed": False}] * steps)
            for w, steps in ((1, 16), (2, 8))]
    (table,) = ranking_card(runs).tables
    assert sorted(table.frame["timed steps"]) == [8, 16]
    assert "16 timed steps" not in table.how and "column 'timed steps'" in table.how


def test_the_kuberay_goal_says_its_checks_are_distlabs_own_not_the_crd_schema(tmp_path):
    import json

    from distlab.report.cards import stage5_ray
    from distlab.report.collect import attach_machine_records

    run = fake_run(tmp_path / "testbox" / "ddp", {"world_size": 2, "micro_batch": 4})
    (tmp_path / "kuberay").mkdir()
    (tmp_path / "kuberay" / "checks.json").write_text(json.dumps({
        "schema_version": 1, "passed": True, "ray_version": "2.60", "experiments": ["x"], "files": {},
        "checks": {"RayCluster": {"api_version": {"status": "passed", "detail": ""}}}}))
    (run,) = attach_machine_records([run])  # the report's reader hands the record to the card on the run
    (goal,) = [g for g in stage5_ray.build([run]).goals if g.text.startswith("KubeRay")]
    assert goal.status == "passed" and "not the KubeRay CRD schema" in goal.text


def test_the_overview_shows_a_compared_goal_as_compared_not_as_not_run():
    from distlab.report.build import overview_card
    from distlab.report.cards import COMPARED, Card, Goal

    card = Card(3, "Stage 3", goals=[Goal("minimal", "a", "passed"), Goal("bonus", "budget", COMPARED)])
    (table,) = overview_card([card], [], {}).tables
    assert list(table.frame["bonus"]) == [COMPARED]


def test_a_speedup_above_linear_is_flagged_with_its_likely_cause_not_passed(tmp_path):
    from distlab.report.cards import DOUBTFUL, PASSED
    from distlab.report.cards.stage1_ddp import build

    # 2 ranks at 2.5x one rank's tokens/s, the 1-rank run timed while others took a core.
    one = fake_run(tmp_path / "1", {"world_size": 1, "micro_batch": 8}, step_median_s=0.25, others_cores=1.3)
    two = fake_run(tmp_path / "2", {"world_size": 2, "micro_batch": 4}, step_median_s=0.1)
    goal = next(g for g in build([one, two]).goals if g.text.startswith("Speedup"))
    assert goal.status == DOUBTFUL and "ABOVE LINEAR" in goal.evidence
    assert f"{one.experiment} was timed" in goal.evidence and "1.3 cores" in goal.evidence
    plain = fake_run(tmp_path / "3", {"world_size": 2, "micro_batch": 4}, step_median_s=0.15)
    assert next(g for g in build([one, plain]).goals if g.text.startswith("Speedup")).status == PASSED


def test_a_compiled_or_checkpointed_one_rank_run_is_never_the_baseline_of_the_speedup(tmp_path):
    from distlab.report.cards.stage1_ddp import build, scaling_groups

    # The default run trains ddp-full-w1-mb8-ga1 beside its compiled and checkpointed twins, all
    # of the same batch: only the plain one may stand for 1 rank against the 2-rank run.
    one = fake_run(tmp_path / "1", {"world_size": 1, "micro_batch": 8}, step_median_s=0.5)
    compiled = fake_run(tmp_path / "c", {"world_size": 1, "micro_batch": 8, "compile": True}, step_median_s=0.3)
    recompute = fake_run(tmp_path / "a", {"world_size": 1, "micro_batch": 8, "activation_checkpointing": "full"},
                         step_median_s=0.7)
    two = fake_run(tmp_path / "2", {"world_size": 2, "micro_batch": 4}, step_median_s=0.3)
    for order in ([one, compiled, recompute, two], [compiled, recompute, one, two]):
        (group,) = scaling_groups(order).values()
        assert group[1].experiment == one.experiment, [r.experiment for r in order]
    goal = next(g for g in build([one, compiled, two]).goals if g.text.startswith("Speedup"))
    assert "1.67x" in goal.evidence and compiled.experiment not in " ".join(goal.links)


def test_offload_faster_than_none_is_flagged_not_passed(tmp_path):
    from distlab.report.cards import DOUBTFUL, PASSED
    from distlab.report.cards.stage3_deepspeed import offload_goal

    ds = {"strategy": "deepspeed", "world_size": 2, "micro_batch": 2}
    plain = fake_run(tmp_path / "p", {**ds, "deepspeed": {"zero_stage": 3}}, "deepspeed", step_median_s=0.2,
                     others_cores=0.9)
    off = fake_run(tmp_path / "o", {**ds, "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu"}}, "deepspeed",
                   step_median_s=0.15)
    faster = offload_goal(plain, off)
    assert faster.status == DOUBTFUL and "0.75x" in faster.evidence and "busy" in faster.evidence
    assert offload_goal(off, plain).status == PASSED  # 1.33x slower: what offload costs


def test_zero3_vs_fsdp_passes_only_at_parity_and_says_why_when_not(tmp_path):
    from distlab.report.cards import DOUBTFUL, FAILED, PASSED
    from distlab.report.cards.stage4_fsdp import parity_goal

    def pair(zero_step, others):
        f = fake_run(tmp_path / "f", {"strategy": "fsdp", "world_size": 2, "micro_batch": 2}, "fsdp", step_median_s=0.1)
        z = fake_run(tmp_path / f"z{zero_step}", {"strategy": "deepspeed", "world_size": 2, "micro_batch": 2,
                                                  "deepspeed": {"zero_stage": 3}}, "deepspeed",
                     step_median_s=zero_step, others_cores=others)
        f, z = (timed(run, [{"step_time_s": run.timing.step_time_s.median, "warmup": False}] * 4) for run in (f, z))
        return parity_goal(f, z)

    assert pair(0.11, 0.0).status == PASSED
    busy = pair(0.9, 1.5)
    assert busy.status == DOUBTFUL and "9.00x" in busy.evidence and "busy" in busy.evidence
    quiet = pair(0.9, 0.0)
    assert quiet.status == FAILED and "quiet machine" in quiet.evidence


def test_the_overview_names_runs_timed_on_a_busy_machine(tmp_path):
    from distlab.report.build import busy_note

    quiet = fake_run(tmp_path / "q", {"world_size": 2, "micro_batch": 4})
    busy = fake_run(tmp_path / "b", {"world_size": 1, "micro_batch": 8}, others_cores=1.5)
    assert busy_note([quiet]).startswith("All 1 timed run(s) ran on a quiet machine")
    note = busy_note([quiet, busy])
    assert note.startswith("BUSY MACHINE: 1 of 2") and busy.experiment in note
    assert "not recorded" in busy_note([fake_run(tmp_path / "n", {"world_size": 1}, others_cores=None)])


def test_the_zero3_trade_says_when_the_lean_profile_saved_no_memory(tmp_path):
    from distlab.report.cards.stage4_fsdp import trade_note

    def zero3(name, step, training_peak_mib, profile):
        run = fake_run(tmp_path / name, {"strategy": "deepspeed", "world_size": 2, "micro_batch": 2,
                                         "deepspeed": {"zero_stage": 3, "zero3_profile": profile}}, "deepspeed",
                       step_median_s=step)
        per_rank = [{**rank, "training_phase": {"rss_peak_bytes": training_peak_mib * 2**20}}
                    for rank in run.memory.per_rank]
        run = changed(run, memory={**run.memory, "per_rank": per_rank})
        return timed(run, [{"step_time_s": step, "warmup": False}] * 4)

    auto = zero3("auto", 0.5, 780, "auto")
    no_saving = trade_note(auto, zero3("lean", 0.8, 789, "lean"))
    assert "1.60x slower" in no_saving and "780 -> 789" in no_saving and "saved no memory" in no_saving
    saving = trade_note(auto, zero3("lean2", 0.8, 600, "lean"))
    assert "saved no memory" not in saving and "780 -> 600" in saving
    faster = trade_note(auto, zero3("lean3", 0.4, 600, "lean"))
    assert "slower" not in faster and "0.80x the step time" in faster


# Calls that read the file system.
FILE_ACCESS = {"open", "read_text", "read_bytes", "is_file", "exists", "glob", "rglob", "iterdir", "listdir",
               "scandir", "read_json", "read_steps", "load_run", "load_runs", "machine_files", "read_csv"}


def test_no_report_card_opens_a_file():
    """A card is a function of the runs it is handed: collect.load_run and the report's door
    (build.read_inputs, pages.py for the opt-in targets' pages) read the files their rule
    declares, so a card cannot read one the rule never declared."""
    import ast
    from pathlib import Path

    import distlab.report.cards as cards

    opened = []
    for path in sorted(Path(cards.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in FILE_ACCESS:
                    opened.append(f"{path.name}:{node.lineno} {name}()")
    assert opened == []


# Built and rendered in a fresh interpreter: runs written and read back through distlab.records.run_outputs
# first, then every open() recorded while the report is built from them in memory.
IN_MEMORY_REPORT = """
import builtins, io, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from card_runs import changed, fake_run

root = Path(sys.argv[1])
runs = [fake_run(root / "a", {"world_size": 1, "micro_batch": 8}),
        fake_run(root / "b", {"world_size": 2, "micro_batch": 4}),
        fake_run(root / "c", {"strategy": "deepspeed", "world_size": 2, "micro_batch": 4,
                              "deepspeed": {"zero_stage": 3}}, "deepspeed", as_built={"deepspeed": {"zero_stage": 3}}),
        fake_run(root / "d", {"strategy": "fsdp", "world_size": 2, "micro_batch": 4}, "fsdp",
                 as_built={"outer_wrapper": "FSDPModule", "wrappers_found": ["FSDPModule"]})]
# the load, training and save peaks distlab.runtime.memory records per rank
peaks = {phase: {"rss_peak_bytes": 2**20} for phase in ("load_phase", "training_phase", "save_phase")}
runs = [changed(run, memory={**run.memory, "per_rank": [{**rank, **peaks} for rank in run.memory.per_rank]})
        for run in runs]
opened, real_open = [], io.open

def recording_open(file, *args, **kwargs):
    if str(file).startswith(str(root)):
        opened.append(str(file))
    return real_open(file, *args, **kwargs)

builtins.open = io.open = recording_open
from distlab.report.build import ReportInputs, report_sections
from distlab.report.cards import links, two_hosts, unequal
from distlab.report.render import render_html, render_markdown

summary = [{"machine": r.machine} for r in runs]  # summary.csv's rows, as the header reads them
sections = report_sections(ReportInputs(runs, summary))
hosts = {"hosts": [{"name": "head", "address": "a"}, {"name": "node", "address": "b"}]}
pages = [unequal.build(runs)[0], links.build(runs, {})[0], two_hosts.build(None, hosts)]
html = render_html(sections + pages, summary, str(root), "")
markdown = render_markdown(sections + pages, summary, str(root), "")
print(json.dumps({"opened": opened, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
                  "titles": [c.title for c in sections], "figures": html.count("data:image/png"),
                  "tables": [t.title for c in sections for t in c.tables]}))
"""


def test_the_report_is_built_from_its_inputs_alone_without_torch(tmp_path):
    """The report's door reads; its cards are functions of what it hands them: built in memory
    from runs (every stage card, the checkpoint table, ranking, loss, the opt-in pages' cards),
    nothing under the results folder is opened and torch is never imported. (The advisor card's
    estimate check counts parameters on torch's meta device: the one exception, with advice.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-c", IN_MEMORY_REPORT, str(tmp_path), str(tests)],
                          capture_output=True, text=True, timeout=300, cwd=tests.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["opened"] == [] and out["torch"] == []
    assert "Strategy ranking across all runs" in out["titles"] and out["figures"] >= 3

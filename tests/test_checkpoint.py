"""Checkpoint promises: what a run saves reloads to the same logits, resumes to the same
losses, loads at another world size, exports to plain Hugging Face (LoRA: a PEFT adapter
folder), and refuses to load when it was altered or made for another model, base or config."""
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import resolve, run_experiment
from distlab.checkpoints import checkpoint as ckpt
from distlab.records.checkpoint_files import MANIFEST, sha256_file, verify_manifest
from distlab.checkpoint_formats.plain import load_plain
from distlab.records.job import Job
from distlab.rank.loop import IndexStream
from distlab.records.run_outputs import read_run_record
from distlab.jobs.validate import validate_run
from test_hygiene import python_process, reaper, sigkill_leaves_nothing, wait_for_ranks  # noqa: F401 (a fixture)
from distlab.records.spec import Spec


TUNED = {"lr_schedule": "cosine", "lr_warmup_steps": 2, "max_grad_norm": 1.0}


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """A 2-rank DDP run of 6 steps with checkpoints every 2 steps, and its validation. It
    fine-tunes with a cosine schedule (warm-up 2, so the resume at step 4 lands mid-decay),
    clipping, eval points every 2 steps and checkpoint_select best."""
    run = tmp_path_factory.mktemp("ckpt") / "ddp-w2"
    run_experiment(prepared, run, resolve({"world_size": 2, "micro_batch": 4, "checkpoint_every": 2, **TUNED,
                                           "eval_every": 2, "checkpoint_select": "best"}))
    result = validate_run(run, str(prepared / "model"), str(prepared / "data32"), run / "validation.json",
                          log_path=str(run / "validate.log"))
    return run, result


def validate_copy(trained, prepared, tmp_path, damage):
    """Validate a damaged copy of the trained run (the original stays intact for other tests)."""
    run = tmp_path / "copy"
    shutil.copytree(trained[0], run)
    damage(run / "checkpoint")
    return validate_run(run, str(prepared / "model"), str(prepared / "data32"), run / "validation.json",
                        log_path=str(run / "validate.log"))


@pytest.mark.parametrize("sampler", ["distributed", "none"])
def test_data_stream_restored_from_its_state_reads_on_where_it_stopped(sampler):
    spec = Spec({"sampler": sampler, "seed": 3, "micro_batch": 4})
    first = IndexStream(40, spec, dp_rank=1, dp_size=2)
    for _ in range(13):  # into the third epoch: epochs and positions both matter
        first.next()
    state = json.loads(json.dumps(first.state()))
    resumed = IndexStream(40, spec, dp_rank=1, dp_size=2).restore(state)
    assert [resumed.next() for _ in range(12)] == [first.next() for _ in range(12)]
    assert state["epoch"] > 0 and state["position"] > 0


@pytest.mark.slow
def test_ddp_checkpoint_validates_reload_reshard_resume_and_export(trained):
    run, result = trained
    checks = result["checks"]
    assert result["passed"] is True, json.dumps(result, indent=1)
    assert checks["reload"]["max_abs_logit_diff"] <= checks["reload"]["tolerance"] == 1e-5
    assert checks["reshard"]["from_world_size"] == 2 and checks["reshard"]["to_world_size"] == 1
    assert checks["reshard"]["status"] == "passed"
    parity = checks["resume_parity"]
    assert parity["resumed_at_step"] == 4 and parity["steps_resumed"] == 2
    assert parity["max_abs_loss_diff"] <= parity["tolerance"]
    # The resumed trajectory is a real one: the loss moved between the two resumed steps.
    assert parity["resumed_losses"][0] != parity["resumed_losses"][1]
    export = checks["export"]
    assert export["max_abs_logit_diff"] <= export["tolerance"] == 1e-5
    assert export["layout"]["files_as_save_pretrained"], export["layout"]
    # The gathered state is the model that trained: its own forward gave the same logits.
    assert export["training_model_max_abs_logit_diff"] <= export["training_model_tolerance"] == 1e-5
    # Mid-schedule: the LR schedule's state came back with the checkpoint, so the resumed steps
    # use the uninterrupted run's (decaying) rates and reach its losses bit for bit.
    assert parity["lrs_identical"] and parity["resumed_lrs"] == parity["uninterrupted_lrs"]
    assert 0 < parity["resumed_lrs"][1] < parity["resumed_lrs"][0] < 3e-4
    assert parity["resumed_losses"] == parity["uninterrupted_losses"]
    sizes = checks["size_and_time"]
    assert sizes["state_bytes"] > 0 and sizes["save_seconds"] > 0 and sizes["load_seconds"] > 0
    assert json.loads((run / "validation.json").read_text())["schema_version"] == 1


@pytest.mark.slow
def test_checkpoint_folder_has_native_state_trainer_state_export_and_manifest(trained):
    run, _ = trained
    final = run / "checkpoint" / "final"
    for name in ["state/model.safetensors", "state/optimizer.pt", "trainer/rank0.json", "trainer/rank1.json",
                 "trainer/rng-rank1.safetensors", "export/config.json", "export/model.safetensors",
                 "export/tokenizer.json", "eval_logits.safetensors", ckpt.META]:
        assert (final / name).is_file(), name
    manifest = json.loads((final / MANIFEST).read_text())["files"]
    assert manifest["state/model.safetensors"]["sha256"] == sha256_file(final / "state/model.safetensors")
    assert verify_manifest(final) == []
    # The mid-run checkpoint validation resumes from moved in; the crash-recovery ones are gone.
    assert (run / "checkpoint" / "step-000004" / MANIFEST).is_file()
    assert not (run / "resume").exists()
    metrics = read_run_record(run / "metrics.json").to_dict()
    assert [s["steps_done"] for s in metrics["checkpoint"]["periodic_saves"]] == [2, 4]


@pytest.mark.slow
def test_best_eval_point_keeps_its_checkpoint_with_export_as_the_selected_model(trained):
    run, _ = trained
    metrics = read_run_record(run / "metrics.json").to_dict()
    points, selected = metrics["eval"]["during_training"], metrics["eval"]["selected"]
    assert [p["steps_done"] for p in points] == [2, 4, 6]
    best = min(points, key=lambda p: p["loss"])
    assert selected["select"] == "best" and selected["loss"] == best["loss"]
    folder = Path(selected["checkpoint"])
    assert folder == run / "checkpoint" / "best" and verify_manifest(folder) == []
    assert selected["checkpoint_steps_done"] == best["steps_done"]
    assert (folder / "export" / "model.safetensors").is_file()
    assert not (run / "best-checkpoint").exists()


@pytest.mark.slow
def test_truncated_checkpoint_file_fails_validation_naming_the_file(trained, prepared, tmp_path):
    def truncate(root):
        path = root / "final" / "state" / "model.safetensors"
        path.write_bytes(path.read_bytes()[:1000])

    result = validate_copy(trained, prepared, tmp_path, truncate)
    assert result["passed"] is False
    problems = result["checks"]["manifest"]["problems"]
    assert any("state/model.safetensors" in p and "truncated" in p for p in problems), problems


@pytest.mark.slow
def test_altered_checkpoint_file_fails_validation_naming_the_file(trained, prepared, tmp_path):
    def flip_a_byte(root):
        path = root / "step-000004" / "state" / "optimizer.pt"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    result = validate_copy(trained, prepared, tmp_path, flip_a_byte)
    assert result["passed"] is False and result["checks"]["reload"]["status"] == "failed"
    problems = result["checks"]["manifest"]["problems"]
    assert any("step-000004/state/optimizer.pt" in p and "sha256" in p for p in problems), problems


@pytest.mark.slow
def test_checkpoint_from_a_different_config_is_refused_naming_the_field(trained):
    run, _ = trained
    meta = ckpt.read_meta(run / "checkpoint" / "final")
    spec = resolve({"world_size": 2, "micro_batch": 4, "checkpoint_every": 2, **TUNED, "lr": 1e-3})
    with pytest.raises(ckpt.CheckpointMismatch, match=r"different experiment config.*field lr 0\.0003"):
        ckpt.check_compatible(meta, spec, meta["model"], "final")
    # Fields that leave the trajectory alone do not block a load.
    ckpt.check_compatible(meta, spec.replace(lr=3e-4, checkpoint_every=5, untimed_steps=1), meta["model"], "final")


@pytest.mark.slow
def test_checkpoint_from_a_different_model_is_refused_naming_the_difference(trained):
    run, _ = trained
    meta = ckpt.read_meta(run / "checkpoint" / "final")
    other = copy.deepcopy(meta["model"])
    other["config"]["hidden_size"] = 128
    other["parameters"]["model.embed_tokens.weight"] = [512, 128]
    spec = resolve({"world_size": 2, "micro_batch": 4, "checkpoint_every": 2})
    with pytest.raises(ckpt.CheckpointMismatch, match="different model.*hidden_size 64 .*vs 128"):
        ckpt.check_compatible(meta, spec, other, "final")


@pytest.mark.slow
@pytest.mark.usefixtures("reaper")
def test_validation_ranks_die_with_the_process_that_started_them(trained, prepared, tmp_path):
    """SIGKILL of the validating process (no clean-up runs) takes its launcher and ranks down."""
    run = tmp_path / "copy"
    shutil.copytree(trained[0], run, ignore=shutil.ignore_patterns("validation-work"))
    args = [str(run), str(prepared / "model"), str(prepared / "data32"), str(tmp_path / "validation.json")]
    validating = python_process(f"from distlab.jobs.validate import validate_run; validate_run(*{args!r})")
    wait_for_ranks(validating, str(run), "distlab.rank.validate_ranks")
    sigkill_leaves_nothing(validating, run)
    assert not (tmp_path / "validation.json").exists()


def logits_of(model, batch):
    with torch.no_grad():
        return model(input_ids=batch).logits.float()


@pytest.mark.slow
def test_export_opens_with_plain_transformers_and_matches_the_saved_logits(trained, prepared):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distlab.checkpoints.export import eval_batch

    final = trained[0] / "checkpoint" / "final"
    model = AutoModelForCausalLM.from_pretrained(str(final / "export")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(final / "export"))
    batch = eval_batch(prepared / "data32")
    saved = load_file(str(final / "eval_logits.safetensors"))["logits"]
    # The logits recorded from the streamed forward are those of the model transformers loads.
    assert torch.equal(logits_of(model, batch), saved)
    prompt = tokenizer("The class", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == prompt.shape[1] + 5
    # Trained weights, not the base model's: the export is the run's result.
    base = AutoModelForCausalLM.from_pretrained(str(prepared / "model")).eval()
    assert not torch.equal(logits_of(base, batch), saved)


@pytest.fixture(scope="module")
def lora(prepared, tmp_path_factory):
    """A 1-rank LoRA run with the merged export opted in, and its validation."""
    run = tmp_path_factory.mktemp("lora") / "lora"
    spec = resolve({"world_size": 1, "micro_batch": 4, "method": "lora", "export": {"merge": True}}, steps=4)
    run_experiment(prepared, run, spec)
    result = validate_run(run, str(prepared / "model"), str(prepared / "data32"), run / "validation.json",
                          log_path=str(run / "validate.log"))
    return run, spec, result


@pytest.mark.slow
def test_lora_checkpoint_holds_the_adapters_only_and_names_its_base(lora, prepared):
    from safetensors.torch import load_file

    run, _, result = lora
    checks = result["checks"]
    assert result["passed"] is True, json.dumps(result, indent=1)
    final = run / "checkpoint" / "final"
    state = load_file(str(final / "state" / "model.safetensors"))
    assert state and all("lora_" in name for name in state), sorted(state)[:3]
    base = ckpt.read_meta(final)["base_model"]
    assert base["weights_sha256"] == {"model.safetensors": sha256_file(prepared / "model" / "model.safetensors")}
    frozen = checks["lora_base_frozen"]
    assert frozen["base_identity_matches"] and frozen["reload_max_abs_logit_diff"] <= 1e-5
    assert checks["reshard"]["to_world_size"] == 2 and checks["reshard"]["status"] == "passed"


@pytest.mark.slow
def test_lora_export_is_a_peft_adapter_folder_that_plain_peft_loads_on_the_base(lora, prepared):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from distlab.checkpoints.export import eval_batch
    from distlab.runtime.model import load_model

    run, _, result = lora
    final = run / "checkpoint" / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (final / "export").iterdir()}
    adapted = PeftModel.from_pretrained(load_model(prepared / "model"), str(final / "export")).eval()
    batch, saved = eval_batch(prepared / "data32"), load_file(str(final / "eval_logits.safetensors"))["logits"]
    assert (logits_of(adapted, batch) - saved).abs().max().item() <= 1e-5
    # The merged model is opt-in (export.merge) and opens with plain transformers.
    merged = AutoModelForCausalLM.from_pretrained(str(final / "export" / "merged")).eval()
    assert (logits_of(merged, batch) - saved).abs().max().item() <= 1e-4
    export = result["checks"]["export"]
    assert export["max_abs_logit_diff"] <= 1e-5 and export["merged_max_abs_logit_diff"] <= 1e-4
    assert export["merged_layout"]["files_as_save_pretrained"]


@pytest.mark.slow
def test_a_lora_resume_against_a_changed_base_is_refused_naming_both_and_keeps_the_adapters(lora, prepared,
                                                                                          tmp_path):
    """The run's mid-run checkpoint put in resume/ of a new run whose base folder differs by one
    bit: the run stops naming both bases, and the adapters it refused are still there."""
    from distlab.jobs.launch import launch

    run, spec, _ = lora
    changed = tmp_path / "changed-base"
    shutil.copytree(prepared / "model", changed)
    weights = changed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of the last weight: the same shapes, another base
    weights.write_bytes(bytes(data))
    again = tmp_path / "again"
    (again / "resume").mkdir(parents=True)
    shutil.copytree(run / "checkpoint" / "step-000002", again / "resume" / "step-000002")
    job = Job(spec=spec, run_dir=str(again), data_dir=str(prepared / "data32"), model_source=str(changed),
              hardware_json=str(prepared / "hardware.json"), env_allowlist=[],
              checkpoint_dir=str(again / "checkpoint"))
    with pytest.raises(RuntimeError):
        launch(job, log_path=str(again / "train.log"), timeout=300)
    log = (again / "train.log").read_text()
    assert f"trained on the base model {prepared / 'model'} (model.safetensors " in log
    assert f"this run's base is {changed} (model.safetensors " in log
    assert (again / "resume" / "step-000002" / MANIFEST).is_file()
    meta = ckpt.read_meta(run / "checkpoint" / "final")
    ckpt.check_base(meta, ckpt.base_identity(str(prepared / "model")), run)  # the unchanged base loads


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class PlainStrategy:
    """What resume touches of a strategy: the plain format's loader over the tiny model."""
    name, data_parallel_rank, data_parallel_size, scheduler = "ddp", 0, 1, None

    def __init__(self, prepared):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(prepared / "model")
        self.optimizer = torch.optim.AdamW(self.model.parameters())

    def unwrapped(self):
        return self.model

    def load_checkpoint(self, path):
        load_plain(self, path)


def resume_in(run_dir, trained, prepared, damage):
    """A new launch's resume in one process (world 1) of `run_dir`, whose resume/ holds the
    trained run's step-4 checkpoint as one rank saved it, then damaged."""
    from types import SimpleNamespace

    from distlab.rank.training_checkpoints import TrainingCheckpoints

    folder = run_dir / "resume" / "step-000004"
    if not folder.parent.is_dir():
        shutil.copytree(trained[0] / "checkpoint" / "step-000004", folder)
        meta = json.loads((folder / ckpt.META).read_text())
        (folder / ckpt.META).write_text(json.dumps(dict(meta, world_size=1)))
        (folder / "trainer" / "rank1.json").unlink()
        (folder / "trainer" / "rng-rank1.safetensors").unlink()
        damage(folder)
    meta = ckpt.read_meta(folder) if folder.is_dir() else ckpt.read_meta(trained[0] / "checkpoint" / "step-000004")
    spec = Spec(dict(meta["spec"], id="ddp-w2"))
    ctx = SimpleNamespace(spec=spec, device=torch.device("cpu"))
    job = Job(spec=spec, run_dir=str(run_dir), checkpoint_dir=str(run_dir / "checkpoint"))
    return TrainingCheckpoints(job, ctx, PlainStrategy(prepared), meta["model"], 64)


def _rewrite_manifest(folder):
    from distlab.records.checkpoint_files import write_manifest

    (folder / MANIFEST).unlink()
    write_manifest(folder)


def _truncate_weights(folder):
    """A short weights file its manifest agrees with (a file already bad when it was listed):
    the loader's own error, not a CheckpointError, and the same one at every rerun."""
    path = folder / "state" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    _rewrite_manifest(folder)


@pytest.mark.slow
def test_a_resume_checkpoint_that_fails_to_load_stops_the_run_naming_it_and_the_rerun_starts_fresh(
        trained, prepared, tmp_path, one_rank_group, capsys):
    from distlab.rank.training_checkpoints import REFUSED_DIR, ResumeFailed

    with pytest.raises(ResumeFailed) as failed:
        resume_in(tmp_path, trained, prepared, _truncate_weights).resume()
    message = str(failed.value)
    assert f"resuming from {tmp_path / 'resume' / 'step-000004'} failed while loading it" in message
    (kept,) = (tmp_path / REFUSED_DIR).glob("step-000004.refused-*")
    assert f"moved to {kept} (kept, not deleted)" in message and "SafetensorError" in message
    assert (kept / "state" / "model.safetensors").stat().st_size == 100  # kept as it was found
    capsys.readouterr()
    rerun = resume_in(tmp_path, trained, prepared, _truncate_weights)
    assert rerun.resume() == 0  # the rerun does not meet it again: it trains from step 0
    log = capsys.readouterr().out
    assert f"{tmp_path / 'resume' / 'step-000004'} was refused by an earlier launch" in log
    assert f"kept as {kept}" in log and "SafetensorError" in log


@pytest.mark.slow
def test_a_refused_resume_checkpoint_is_kept_and_named_never_deleted(trained, prepared, tmp_path, one_rank_group):
    from distlab.rank.training_checkpoints import REFUSED_DIR, REFUSED_LOG

    def other_config(folder):
        meta = json.loads((folder / ckpt.META).read_text())
        meta["spec"]["lr"] = 1.0  # made for another config: refused before anything loads
        (folder / ckpt.META).write_text(json.dumps(meta))
        _rewrite_manifest(folder)

    checkpoints = resume_in(tmp_path, trained, prepared, other_config)
    checkpoints.spec = checkpoints.spec.replace(lr=3e-4)
    assert checkpoints.resume() == 0
    (kept,) = (tmp_path / REFUSED_DIR).glob("step-000004.refused-*")
    assert (kept / MANIFEST).is_file() and not (tmp_path / "resume" / "step-000004").exists()
    (skipped,) = checkpoints.report["skipped"]
    assert "field lr 1.0 (checkpoint) vs 0.0003 (this run)" in skipped and f"kept as {kept}" in skipped
    (line,) = (tmp_path / REFUSED_DIR / REFUSED_LOG).read_text().splitlines()
    assert json.loads(line)["kept_as"] == str(kept)


def test_past_a_million_steps_pruning_keeps_the_newest_checkpoint_by_step_number(tmp_path):
    """Folder names are zero-padded to 6 digits: by name step-1000000 sorts before step-999999,
    and the newest checkpoint would be the one removed."""
    from distlab.rank.training_checkpoints import prune_periodic

    for step in (999_998, 999_999, 1_000_000):
        (tmp_path / f"step-{step:06d}").mkdir()
    assert prune_periodic(tmp_path, keep=1, parity_step=None) == ["step-999998", "step-999999"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-1000000"]


def test_checkpoint_keep_keeps_the_newest_periodic_saves_and_the_one_validation_resumes_from(tmp_path):
    from distlab.rank.training_checkpoints import prune_periodic

    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"step-{step:06d}").mkdir()
    (tmp_path / "step-000012.tmp").mkdir()  # a save in progress is never a candidate
    assert prune_periodic(tmp_path, keep=2, parity_step=4) == ["step-000002", "step-000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000008", "step-000010",
                                                          "step-000012.tmp"]
    assert prune_periodic(tmp_path, keep=1, parity_step=None) == ["step-000004", "step-000008"]

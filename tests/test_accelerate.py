"""Stage 2 promises: Hugging Face Accelerate started by `accelerate launch` with a config file
generated per experiment and saved beside the results (the file the launch read), single vs
multi process by that file alone, accumulation through Accelerate, honest fidelity records."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, resolve, run_experiment
from distlab.records.run_outputs import read_run_record
from test_lora import assert_only_adapters_changed

ACC = {"strategy": "accelerate", "method": "lora", "micro_batch": 2}


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    """LoRA through Accelerate on 1 and 2 processes (same spec otherwise), 2 processes with
    2 accumulated micro-batches, and DDP at the same global batch for reference."""
    root = tmp_path_factory.mktemp("accelerate")
    # The accumulation pair also fine-tunes as people do: linear decay after 2 warm-up steps,
    # clipping through accelerator.clip_grad_norm_ (a norm the adapters exceed), and Accelerate's
    # run recomputes every 2nd layer (activation checkpointing selective) while DDP keeps them all.
    tuned = {"lr_schedule": "linear", "lr_warmup_steps": 2, "max_grad_norm": 0.05, "lr": 1e-3}
    plan = {
        "w1": ({**ACC, "world_size": 1}, False),
        "w2": ({**ACC, "world_size": 2}, True),
        "w2ga2": ({**ACC, "world_size": 2, "grad_accum": 2, **tuned, "activation_checkpointing": "selective"}, False),
        "ddp": ({"strategy": "ddp", "method": "lora", "world_size": 2, "micro_batch": 4, **tuned}, False),
    }
    out = {}
    for name, (overrides, checkpoint) in plan.items():
        spec = resolve(overrides, stage="accelerate" if overrides["strategy"] == "accelerate" else "ddp")
        out[name] = run_experiment(prepared, root / name, spec, checkpoint=checkpoint)
        out[name]["_dir"] = str(root / name)
    return out


def saved_config(run) -> tuple[dict, bytes]:
    raw = (Path(run["_dir"]) / "run_files" / "accelerate_config.yaml").read_bytes()
    return yaml.safe_load(raw), raw


def by_hand(run_dir: Path) -> subprocess.CompletedProcess:
    """The rerun command the saved config file prints, run as a user would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(run_dir / "run_files" / "accelerate_config.yaml"), "-m", "distlab.rank.worker", "--job",
           str(run_dir / "job.json")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


# -- config and fidelity (no processes) ---------------------------------------------------------
def test_generated_accelerate_configs_load_in_accelerate_for_every_layout(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from distlab.configuration.config import load
    from distlab.launchers.accelerate import write_accelerate_config
    from conftest import tiny_config

    cfg = tiny_config({"accelerate": {"experiments": [
        {"strategy": "accelerate", "world_size": 1, "device": "cuda"},
        {"strategy": "accelerate", "world_size": 2, "device": "cuda", "precision": "bf16"}]},
        "fsdp": {"experiments": [{"strategy": "fsdp", "world_size": 2, "device": "cuda",
                                  "fsdp": {"via": "accelerate", "reshard_after_forward": False}}]}})
    _, specs = load(cfg, gpu_count=2)
    specs["cpu-w2"] = resolve({"strategy": "accelerate", "world_size": 2}, stage="accelerate")
    seen = {}
    for name, spec in specs.items():
        assert spec["launcher"] == "accelerate"
        path = write_accelerate_config(spec, tmp_path / name, "job.json")
        loaded = load_config_from_file(str(path))  # Accelerate's own reader
        seen[name] = (loaded.distributed_type.value, loaded.num_processes, loaded.use_cpu, loaded.mixed_precision)
    assert seen["accelerate-full-w1-mb4-ga1"] == ("NO", 1, False, "no")
    assert seen["accelerate-full-w2-mb4-ga1"] == ("MULTI_GPU", 2, False, "bf16")
    assert seen["cpu-w2"] == ("MULTI_GPU", 2, True, "no")  # the torchrun-based launcher, on CPU ranks
    fsdp_id = next(k for k in specs if k.startswith("fsdp"))
    assert seen[fsdp_id][:2] == ("FSDP", 2)
    fsdp_file = load_config_from_file(str(tmp_path / fsdp_id / "accelerate_config.yaml"))
    assert fsdp_file.fsdp_config["fsdp_version"] == 2 and fsdp_file.fsdp_config["fsdp_reshard_after_forward"] is False


def test_fsdp_through_accelerate_on_cpu_is_refused_naming_the_field():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"stages\.fsdp\.experiments\[0\]\.fsdp\.via.*CUDA"):
        resolve({"strategy": "fsdp", "world_size": 2, "fsdp": {"via": "accelerate"}}, stage="fsdp")


def test_accelerate_launch_is_refused_for_strategies_it_does_not_run():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"experiments\[0\]\.launcher.*use torchrun"):
        resolve({"strategy": "ddp", "launcher": "accelerate"})


def fake_strategy(spec):
    from distlab.strategies.accelerate import AccelerateStrategy
    from distlab.strategies.base import RunContext

    import torch

    return AccelerateStrategy(RunContext(spec=spec, run_dir=".", device=torch.device("cpu")))


def described(world, wrapped, dtype, processes, device="cpu"):
    return {"world_size": world, "wrappers_found": [], "device": device, "outer_wrapper": "X", "wrapped_by": wrapped,
            "accelerate": {"distributed_type": dtype, "num_processes": processes, "launched_with": None}}


def test_fidelity_check_fails_a_rank_that_accelerate_left_alone():
    from distlab.strategies.base import FidelityError

    spec = resolve({"strategy": "accelerate", "world_size": 2}, stage="accelerate")
    strategy = fake_strategy(spec)
    strategy.verify(described(2, "DistributedDataParallel", "MULTI_CPU", 2))  # the honest run passes
    # The CPU trap: without cpu=True each rank reports DistributedType.NO, one process, no wrapper.
    with pytest.raises(FidelityError, match="world_size 2"):
        strategy.verify(described(1, "none", "NO", 1))
    with pytest.raises(FidelityError, match="Accelerate runs 1 process"):
        strategy.verify(described(2, "none", "NO", 1))
    with pytest.raises(FidelityError, match="should wrap the model in DistributedDataParallel"):
        strategy.verify(described(2, "none", "MULTI_CPU", 2))


def test_fidelity_check_never_lets_ddp_pass_as_fsdp():
    from distlab.configuration.config import load
    from distlab.strategies.base import FidelityError
    from conftest import tiny_config

    _, specs = load(tiny_config({"fsdp": {"experiments": [
        {"strategy": "fsdp", "world_size": 2, "device": "cuda", "fsdp": {"via": "accelerate"}}]}}), gpu_count=2)
    (spec,) = specs.values()
    strategy = fake_strategy(spec)
    # What Accelerate does with an FSDP plugin and cpu=True: DDP, not FSDP.
    with pytest.raises(FidelityError, match="refusing to report it under an FSDP label"):
        strategy.verify(described(2, "DistributedDataParallel", "FSDP", 2, device="cuda"))
    with pytest.raises(FidelityError, match="needs FSDP"):
        strategy.verify(described(2, "DistributedDataParallel", "MULTI_GPU", 2, device="cuda"))


# -- real runs ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_accelerate_launch_reads_the_config_file_saved_beside_the_results(runs):
    run = runs["w2"]
    config, raw = saved_config(run)
    assert config["num_processes"] == 2 and config["use_cpu"] is True and config["mixed_precision"] == "no"
    launched = run["as_built"]["accelerate"]["launched_with"]
    assert launched["sha256"] == hashlib.sha256(raw).hexdigest()  # the file on disk, unchanged since
    assert launched["rank_env_mixed_precision"] == "no"  # exported to the ranks by accelerate launch
    first = (Path(run["_dir"]) / "train.log").read_text().splitlines()[0]
    config_file = Path(run["_dir"]) / "run_files" / "accelerate_config.yaml"
    assert "accelerate.commands.launch --config_file" in first and str(config_file) in first
    assert run["as_built"]["world_size"] == 2 and run["as_built"]["accelerate"]["distributed_type"] == "MULTI_CPU"
    assert run["as_built"]["wrapped_by"] == "DistributedDataParallel"


@pytest.mark.slow
def test_single_and_multi_process_runs_differ_only_in_the_accelerate_config_file(runs):
    one, two = runs["w1"], runs["w2"]
    assert {k: v for k, v in one["spec"].items() if k not in ("id", "world_size")} == \
           {k: v for k, v in two["spec"].items() if k not in ("id", "world_size")}
    file_one, file_two = saved_config(one)[0], saved_config(two)[0]
    assert {k for k in file_one if file_one[k] != file_two.get(k)} == {"distributed_type", "num_processes"}
    assert (one["as_built"]["world_size"], two["as_built"]["world_size"]) == (1, 2)
    assert (one["as_built"]["accelerate"]["distributed_type"], two["as_built"]["accelerate"]["distributed_type"]) == \
           ("NO", "MULTI_CPU")
    assert one["data"]["per_rank_reads"] == [12] and two["data"]["per_rank_reads"] == [12, 12]
    assert two["data"]["duplicate_reads"] == 0


@pytest.mark.slow
def test_accelerate_gradient_accumulation_matches_ddp_at_the_same_global_batch(runs):
    """2 ranks x 2 micro-batches of 2 through accelerator.accumulate/backward == DDP, 2 ranks x 4."""
    accumulated, ddp, plain = runs["w2ga2"], runs["ddp"], runs["w2"]
    for a, b in zip(accumulated["loss"]["per_step"], ddp["loss"]["per_step"]):
        assert abs(a - b) < 1e-5, (accumulated["loss"]["per_step"], ddp["loss"]["per_step"])
    # Same schedule and the same pre-clip norm (above max_grad_norm: clipped) as DDP's.
    mine, theirs = accumulated["optimization"], ddp["optimization"]
    assert mine["lr_per_step"] == theirs["lr_per_step"] and len(set(mine["lr_per_step"])) > 3
    for a, b in zip(mine["grad_norm_per_step"], theirs["grad_norm_per_step"]):
        assert abs(a / b - 1) < 1e-4 and b > ddp["spec"]["max_grad_norm"], (mine, theirs)
    assert accumulated["as_built"]["activation_checkpointing"]["checkpointed"] == [0]
    counts = accumulated["as_built"]["accelerate"]["counts"]
    assert counts["micro_batches"] == 12 and counts["optimizer_steps_taken"] == 6 and counts["gradient_syncs"] == 6
    # Gradients are all-reduced once per optimizer step, not once per micro-batch.
    assert counts["allreduce_calls"] == plain["as_built"]["accelerate"]["counts"]["allreduce_calls"] > 0


@pytest.mark.slow
def test_accelerate_lora_checkpoint_keeps_the_base_weights_bit_identical(prepared, runs):
    run = runs["w2"]
    assert_only_adapters_changed(Path(run["_dir"]) / "checkpoint" / "final", prepared, run["spec"])


@pytest.mark.slow
def test_the_saved_command_reruns_the_experiment_by_hand_and_reads_the_file(runs):
    run_dir = Path(runs["w1"]["_dir"])
    first = runs["w1"]["loss"]["per_step"]
    proc = by_hand(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = read_run_record(run_dir / "metrics.json").to_dict()
    assert again["loss"]["per_step"] == first
    # Edit the file: the next launch must see the edit (and refuse it, the spec says fp32).
    path = run_dir / "run_files" / "accelerate_config.yaml"
    path.write_text(path.read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    proc = by_hand(run_dir)
    assert proc.returncode != 0
    assert "accelerate_config.yaml says mixed_precision bf16, spec precision is fp32" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_card2_goals_are_computed_from_the_runs(runs, tmp_path):
    from conftest import load_filed
    from distlab.records.spec import thaw
    from distlab.report.cards import PASSED
    from distlab.report.cards.stage2_accelerate import build

    loaded = [load_filed(runs[name]["_dir"], tmp_path) for name in ("w1", "w2", "w2ga2")]
    card = build(loaded)
    goals = {g.text: g for g in card.goals}
    assert [g.kind for g in card.goals] == ["minimal", "minimal", "bonus"]
    assert all(g.status == PASSED for g in card.goals), [(g.text, g.status, g.evidence) for g in card.goals]
    switch = goals["Switch single/multi device by the Accelerate config file alone"]
    assert "real world sizes 1 and 2" in switch.evidence
    sweep = next(t for t in card.tables if t.title == "Gradient accumulation sweep").frame
    assert list(sweep["grad accum"]) == [1, 2] and list(sweep["micro-batches per step (measured)"]) == [1.0, 2.0]
    assert list(sweep["optimizer steps taken"]) == [6, 6]
    # A run whose counters disagree with its spec fails the goal instead of passing silently.
    from card_runs import changed

    as_built = thaw(loaded[2].as_built)
    as_built["accelerate"]["counts"]["optimizer_steps_taken"] = 5
    assert build([*loaded[:2], changed(loaded[2], as_built=as_built)]).goals[2].status == "failed"


@pytest.mark.slow
def test_the_saved_config_runs_accelerates_own_test_as_one_group_of_two(runs):
    """`accelerate test --config_file <saved file>` with the environment the file's rerun line
    sets: both ranks in one MULTI_CPU group (alone, each would report DistributedType.NO, 1 process)."""
    path = Path(runs["w2"]["_dir"]) / "run_files" / "accelerate_config.yaml"
    rerun = next(line for line in path.read_text().splitlines() if "accelerate launch --config_file" in line)
    words = rerun.lstrip("# ").split()
    assigned = dict(w.split("=", 1) for w in words[:words.index("accelerate")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(assigned, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "test", "--config_file",
                           str(path)], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("Num processes: 2") == 2 and "Num processes: 1" not in out, out[-3000:]
    assert out.count("DistributedType.MULTI_CPU") == 2
    assert "Process index: 0" in out and "Process index: 1" in out

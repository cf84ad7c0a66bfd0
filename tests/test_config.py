"""Config promises: bad input stops with a message naming the field; specs resolve predictably."""
import copy
from pathlib import Path

import pytest

from conftest import REPO, tiny_config
from distlab.configuration.config import ConfigError, EXPERIMENT_DEFAULTS, experiment_id, load
from distlab.records.spec import Spec


def specs_of(cfg, gpus=0):
    return load(cfg, gpu_count=gpus)[1]


def ddp_config(*experiments, **top):
    return tiny_config({"ddp": {"experiments": list(experiments)}}, **top)


BAD_CONFIGS = [
    # (description, mutate(cfg), field named in the error)
    ("unknown top-level key", lambda c: c.update(epochs=3), "epochs"),
    ("unknown experiment key", lambda c: c["stages"]["ddp"]["experiments"][0].update(wrld_size=2), "wrld_size"),
    ("world size 0", lambda c: c["stages"]["ddp"]["experiments"][0].update(world_size=0), "world_size"),
    ("world size as text", lambda c: c["stages"]["ddp"]["experiments"][0].update(world_size="2"), "world_size"),
    ("steps fewer than warm-up", lambda c: c["stages"]["ddp"]["experiments"][0].update(steps=3, untimed_steps=3),
     "untimed_steps"),
    ("sequence beyond the model's positions", lambda c: c["stages"]["ddp"]["experiments"][0].update(seq_len=4096),
     "seq_len"),
    ("model path that does not exist", lambda c: c["model"].update(path="/nonexistent/model"), "model.path"),
    ("unknown strategy", lambda c: c["stages"]["ddp"]["experiments"][0].update(strategy="horovod"), "strategy"),
    ("negative learning rate", lambda c: c["stages"]["ddp"]["experiments"][0].update(lr=-1.0), "lr"),
    ("unknown stage", lambda c: c["stages"].update(stage9={"experiments": []}), "stages"),
    ("data file missing", lambda c: c["data"].update(source="files", files=["/nope.txt"]), "data.files[0]"),
    ("heads not dividing width", lambda c: c["model"]["build"].update(hidden_size=66), "num_attention_heads"),
    ("cuda without GPUs", lambda c: c["stages"]["ddp"]["experiments"][0].update(device="cuda"), "device"),
    ("param offload without ZeRO-3", lambda c: c["stages"]["ddp"]["experiments"][0].update(
        strategy="deepspeed", deepspeed={"zero_stage": 2, "offload_param": "cpu"}), "deepspeed.offload_param"),
    ("fp16 on CPU", lambda c: c["stages"]["ddp"]["experiments"][0].update(precision="fp16"), "precision"),
    ("two experiments with one id", lambda c: c["stages"]["ddp"]["experiments"].append(
        copy.deepcopy(c["stages"]["ddp"]["experiments"][0])), "experiments[1]"),
    ("learning rate NaN", lambda c: c["stages"]["ddp"]["experiments"][0].update(lr=float("nan")),
     "stages.ddp.experiments.0.lr"),
    ("infinite weight decay", lambda c: c["defaults"].update(weight_decay=float("inf")), "defaults.weight_decay"),
    ("world size 2.0", lambda c: c["stages"]["ddp"]["experiments"][0].update(world_size=2.0),
     "stages.ddp.experiments.0.world_size"),
    ("empty results_dir", lambda c: c.update(results_dir=""), "results_dir"),
    ("results_dir under /proc", lambda c: c.update(results_dir="/proc/x"), "results_dir"),
    ("results_dir /var", lambda c: c.update(results_dir="/var"), "is a system or shared folder"),
    ("results_dir /home", lambda c: c.update(results_dir="/home/"), "is a system or shared folder"),
    ("results_dir /opt", lambda c: c.update(results_dir="/opt"), "is a system or shared folder"),
    ("results_dir ~", lambda c: c.update(results_dir="~/results"), "'~' is not expanded"),
    ("results_dir the repository", lambda c: c.update(results_dir=str(REPO)), "project's own"),
    ("results_dir its sources", lambda c: c.update(results_dir=str(REPO / "distlab" / "out")), "project's own"),
    ("results_dir relative into sources", lambda c: c.update(results_dir="rules/.."), "project's own"),
    ("machine named like the prep folder", lambda c: c.update(machine="prep"), "machine"),
    ("machine named like the report folder", lambda c: c.update(machine="report"), "machine"),
    ("steps and epochs in one experiment", lambda c: c["stages"]["ddp"]["experiments"][0].update(steps=4, epochs=1),
     "stages.ddp.experiments[0].epochs"),
    ("LR warm-up as steps and as a ratio", lambda c: c["defaults"].update(lr_warmup_steps=2, lr_warmup_ratio=0.1),
     "defaults.lr_warmup_ratio"),
    ("LR warm-up longer than the run", lambda c: c["stages"]["ddp"]["experiments"][0].update(lr_warmup_steps=99),
     "lr_warmup_steps"),
    ("unknown LR schedule", lambda c: c["defaults"].update(lr_schedule="onecycle"), "defaults.lr_schedule"),
    ("negative max_grad_norm", lambda c: c["defaults"].update(max_grad_norm=-1.0), "defaults.max_grad_norm"),
    ("unknown tracker", lambda c: c["defaults"].update(tracking=["wandb"]), "defaults.tracking"),
    ("best checkpoint without eval points", lambda c: c["stages"]["ddp"]["experiments"][0].update(
        checkpoint_select="best"), "checkpoint_select"),
    ("selective checkpointing of every layer", lambda c: c["defaults"].update(activation_checkpointing_every=1),
     "activation_checkpointing_every"),
    ("old and new name of the untimed steps", lambda c: c["defaults"].update(warmup_steps=1, untimed_steps=1),
     "defaults.warmup_steps"),
]


@pytest.mark.parametrize("what,mutate,field", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_is_refused_with_the_field_named(what, mutate, field):
    cfg = ddp_config({"world_size": 1})
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        load(cfg, gpu_count=0)
    assert field in str(err.value), str(err.value)


def test_experiment_inherits_defaults_then_config_defaults_then_overrides():
    cfg = ddp_config({"world_size": 2, "lr": 1e-3})
    cfg["defaults"]["steps"] = 11
    (spec,) = specs_of(cfg).values()
    assert spec["world_size"] == 2 and spec["lr"] == 1e-3  # experiment override
    assert spec["steps"] == 11  # config defaults
    assert spec["weight_decay"] == EXPERIMENT_DEFAULTS["weight_decay"]  # built-in default
    assert spec["stage"] == "ddp" and spec["device"] == "cpu" and spec["launcher"] == "torchrun"


def test_nested_strategy_options_merge_key_by_key():
    cfg = ddp_config({"strategy": "deepspeed", "world_size": 2, "deepspeed": {"zero_stage": 3}})
    (spec,) = specs_of(cfg).values()
    assert spec["deepspeed"]["zero_stage"] == 3
    assert spec["deepspeed"]["offload_optimizer"] == EXPERIMENT_DEFAULTS["deepspeed"]["offload_optimizer"]


def test_experiment_ids_read_like_the_spec():
    cfg = ddp_config({"world_size": 2, "micro_batch": 4}, {"world_size": 2, "micro_batch": 4, "sampler": "none",
                                                            "tag": "nosampler"},
                     {"strategy": "deepspeed", "world_size": 2, "deepspeed": {"zero_stage": 3,
                                                                              "offload_optimizer": "cpu"}})
    assert list(specs_of(cfg)) == ["ddp-full-w2-mb4-ga1", "ddp-full-w2-mb4-ga1-nosampler",
                                   "deepspeed-z3-offopt-full-w2-mb4-ga1"]


def test_device_auto_means_cuda_only_where_gpus_exist():
    cfg = ddp_config({"world_size": 1, "device": "auto"})
    assert next(iter(specs_of(copy.deepcopy(cfg), gpus=0).values()))["device"] == "cpu"
    assert next(iter(specs_of(copy.deepcopy(cfg), gpus=2).values()))["device"] == "cuda"


def test_disabled_stage_contributes_no_experiment():
    cfg = ddp_config({"world_size": 1})
    cfg["stages"]["fsdp"] = {"enabled": False, "experiments": [{"strategy": "fsdp", "world_size": 2}]}
    assert all(s["stage"] == "ddp" for s in specs_of(cfg).values())


def test_schema_defaults_fill_missing_sections():
    cfg, _ = load(ddp_config({"world_size": 1}), gpu_count=0)
    assert cfg["results_dir"] == "results" and cfg["machine"] is None
    assert "OMP_NUM_THREADS" in cfg["env_allowlist"]


def test_id_is_a_pure_function_of_the_spec():
    spec = Spec(dict(EXPERIMENT_DEFAULTS, stage="ddp", launcher="torchrun"))
    assert experiment_id(spec) == experiment_id(copy.deepcopy(spec)) == "ddp-full-w1-mb4-ga1"


def test_validation_scope_picks_one_experiment_per_strategy_method_and_launcher():
    from distlab.configuration.validation_scope import validated_experiments

    cfg = ddp_config({"world_size": 1, "micro_batch": 8}, {"world_size": 2}, {"world_size": 2, "method": "lora"})
    cfg, specs = load(cfg, gpu_count=0)
    assert validated_experiments(cfg, specs) == ["ddp-full-w1-mb8-ga1", "ddp-lora-w2-mb4-ga1"]
    cfg["validation"]["scope"] = "all"
    assert validated_experiments(cfg, specs) == list(specs)
    cfg["validation"]["scope"] = "none"
    assert validated_experiments(cfg, specs) == []


def model_folder(tmp_path, config_text: str, weights: bool = True):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


def test_a_junk_model_config_json_is_refused_naming_the_file_and_line(tmp_path):
    folder = model_folder(tmp_path, '{"model_type": "llama",\n  oops}')
    with pytest.raises(ConfigError, match=rf"model.path.*{folder / 'config.json'} is not valid JSON \(line 2"):
        load(ddp_config({"world_size": 1}, model={"path": str(folder)}), gpu_count=0)


def test_a_model_folder_without_weights_is_refused_before_any_job(tmp_path, monkeypatch):
    import distlab.configuration.tokenizer_checks

    # This folder has no tokenizer either (refused on its own: tests/test_data_tokenizer.py).
    monkeypatch.setattr(distlab.configuration.tokenizer_checks, "check_tokenizer", lambda config: None)
    folder = model_folder(tmp_path, '{"model_type": "llama"}', weights=False)
    config = ddp_config({"world_size": 1}, model={"path": str(folder)})
    config["results_dir"] = str(tmp_path / "results")
    load(copy.deepcopy(config), gpu_count=0)  # a config-only folder is enough for the advisor
    with pytest.raises(ConfigError, match="model.path.*has no weights"):
        load(config, gpu_count=0, probe=True)  # what the workflow runs before any job


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    from distlab.configuration.config import load_file

    path = tmp_path / "config.yaml"
    path.write_text("stages:\n  ddp:\n    experiments: [{world_size: 2\n  foo: bar\n")
    with pytest.raises(ConfigError, match=rf"{path}, line 4"):
        load_file(path)


def ray_config(address):
    return tiny_config({"ray": {"experiments": [{"world_size": 2, "launcher": "ray"}]}}, ray={"address": address})


def test_an_empty_ray_address_is_refused_before_any_job(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "")
    with pytest.raises(ConfigError, match="ray.address.*RAY_ADDRESS, which is empty"):
        load(ray_config("env"), gpu_count=0, probe=True)


def test_an_unreachable_ray_head_is_refused_naming_the_address():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"ray.address.*Ray head 127.0.0.1:{port} is not reachable"):
        load(ray_config(f"127.0.0.1:{port}"), gpu_count=0, probe=True)



@pytest.mark.parametrize("auth, refusal", [
    ({}, r"needs token auth, but RAY_AUTH_MODE is 'not set'"),
    ({"RAY_AUTH_MODE": "disabled"}, r"needs token auth, but RAY_AUTH_MODE is 'disabled'"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{tmp}/missing"}, r"no token in RAY_AUTH_TOKEN and no file"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{tmp}/token"}, None),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "abc"}, None),
])
def test_a_ray_head_is_driven_only_with_token_auth(monkeypatch, tmp_path, auth, refusal):
    """Ray sends no token to an address it is given unless RAY_AUTH_MODE says token: such a
    driver is refused by a head with auth and would use an open one as if nothing were wrong."""
    import socket

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token of this machine's user
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    for key, value in auth.items():
        monkeypatch.setenv(key, value.format(tmp=tmp_path))
    (tmp_path / "token").write_text("t" * 64)
    with socket.socket() as head:  # a reachable "head": the probe only connects
        head.bind(("127.0.0.1", 0))
        head.listen(1)
        address = f"127.0.0.1:{head.getsockname()[1]}"
        if refusal is None:
            load(ray_config(address), gpu_count=0, probe=True)
        else:
            with pytest.raises(ConfigError, match=rf"ray.address.*Ray head {address}.*{refusal}.*RAY_AUTH_MODE=token"):
                load(ray_config(address), gpu_count=0, probe=True)

def test_a_results_dir_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="results_dir.*is not writable.*is not a folder"):
        load(ddp_config({"world_size": 1}, results_dir=str(tmp_path / "a-file" / "results")), gpu_count=0, probe=True)


def test_a_configfile_with_a_yaml_syntax_error_is_named_by_distlab_check_config(tmp_path, capsys):
    from distlab.configuration.check_config import main

    bad = tmp_path / "mine.yaml"
    bad.write_text("stages:\n  ddp:\n    experiments: [{world_size: 2\n  foo: bar\n")
    default = Path(__file__).resolve().parent.parent / "config" / "config.yaml"
    assert main([str(bad), str(default)]) == 1  # one bad file fails the command
    err = capsys.readouterr()
    assert f"{bad}, line 4" in err.err
    assert f"{default}: ok" in err.out


def test_epochs_or_max_tokens_replace_the_steps_they_inherit_and_resolve_to_optimizer_steps(tmp_path):
    import json

    from distlab.configuration.finetune_config import resolve_epochs

    # max_tokens: known at config time. 2000 tokens / (4 x 2 accumulated x 2 ranks x 32) = 3.9 -> 4 steps.
    (spec,) = load(ddp_config({"world_size": 2, "grad_accum": 2, "max_tokens": 2000}), gpu_count=0)[1].values()
    assert spec["steps"] == 4 and spec["length"]["from"] == "max_tokens" and spec["epochs"] is None
    # epochs: the prepared data's train blocks decide, once they exist (distlab.jobs.launch).
    (spec,) = load(ddp_config({"world_size": 2, "epochs": 1.5, "lr_warmup_ratio": 0.1}), gpu_count=0)[1].values()
    assert spec["steps"] is None and spec["length"]["from"] == "epochs"
    (tmp_path / "distlab_data.json").write_text(json.dumps({"splits": {"train": {"blocks": 101}}}))
    resolved = resolve_epochs(spec, tmp_path)
    # 101 blocks over 2 ranks = 50 each, 12 micro-batches of 4 per epoch; 1.5 epochs = 18 steps,
    # warm-up ceil(0.1 x 18) = 2 steps.
    assert resolved["steps"] == 18 and resolved["length"]["micro_batches_per_epoch_per_rank"] == 12
    assert resolved["lr_warmup_steps"] == 2
    # Checked like any length once known: 2 untimed steps leave nothing to time in 1 step.
    too_short = dict(spec, epochs=0.05)
    with pytest.raises(ConfigError, match="config field 'untimed_steps' of experiment"):
        resolve_epochs(too_short, tmp_path)


def test_warmup_steps_still_works_and_says_it_means_untimed_steps_not_the_lr_warm_up():
    from distlab.configuration.finetune_config import ConfigDeprecation

    cfg = ddp_config({"world_size": 1})
    cfg["defaults"].pop("untimed_steps")
    cfg["defaults"]["warmup_steps"] = 3
    with pytest.warns(ConfigDeprecation, match=r"defaults\.warmup_steps.*steps left out of the timing.*not the "
                                               r"learning-rate warm-up.*untimed_steps"):
        (spec,) = load(cfg, gpu_count=0)[1].values()
    assert spec["untimed_steps"] == 3 and "warmup_steps" not in spec and spec["lr_warmup_steps"] == 0


def test_the_docs_three_epoch_fine_tune_config_loads(prepared, tmp_path):
    import json
    import re

    import yaml

    from conftest import REPO

    page = (REPO / "docs" / "fine-tuning.md").read_text()
    section = page.split("## Fine-tune my own model for 3 epochs", 1)[1]
    cfg = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                       {"role": "assistant", "content": f"a{i}"}]})
                              for i in range(5)))
    cfg["model"]["path"], cfg["data"]["files"] = str(prepared / "model"), [str(chat)]
    cfg["results_dir"] = str(tmp_path / "results")
    cfg["defaults"]["seq_len"] = 32  # the tests' model has 128 positions
    (spec,) = load(cfg, gpu_count=2)[1].values()
    assert spec["epochs"] == 3 and spec["steps"] is None and spec["lr_schedule"] == "cosine"
    assert spec["activation_checkpointing"] == "full" and spec["tracking"] == ["tensorboard", "mlflow"]

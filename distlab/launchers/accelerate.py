"""`accelerate launch` for one experiment.

The Accelerate config file is generated from the experiment's spec and written beside its
results (run_dir/run_files/accelerate_config.yaml) before the launch reads it, so the file on disk is
the one used and `accelerate launch --config_file <it> -m distlab.worker --job <job.json>`
reruns the experiment by hand. Variables named ACCELERATE_* are removed from the launch
environment so that file is the only source of Accelerate settings.

Trap (checked with accelerate 1.15 on a CPU-only machine): a `distributed_type: MULTI_CPU`
config with `num_processes: 2` on one machine starts ONE process (Accelerate's plain
launcher; it spawns CPU ranks only through mpirun), which then reports
DistributedType.NO. The launcher that starts N local ranks is Accelerate's torchrun-based
one, which it selects for `distributed_type: MULTI_GPU`; with `use_cpu: true` (and the
strategy's Accelerator(cpu=True)) those ranks run on CPU over gloo and Accelerate itself
reports MULTI_CPU. The strategy records the type Accelerate reports at run time and fails
the run when it is not the one the experiment needs.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from distlab.launchers.environment import single_node_environment
from distlab.launchers.process import run_ranks
from distlab.precision import ACCELERATE_MIXED_PRECISION
from distlab.run_layout import run_files_dir
from distlab.strategies.accelerate_settings import CONFIG_NAME, uses_accelerate_fsdp
from distlab.strategies.settings import settings_for
from distlab.sharing import portable

def config_distributed_type(spec: dict) -> str:
    """The distributed_type written to the config file (what selects Accelerate's launcher)."""
    plugin = settings_for(spec).accelerate_plugin(spec)  # FSDP through Accelerate
    if plugin:
        return plugin
    if spec["world_size"] == 1:
        return "NO"
    # MULTI_GPU selects the torchrun-based launcher, also for CPU ranks: see the module note.
    return "MULTI_GPU"


def accelerate_config(spec: dict) -> dict:
    """The Accelerate config file's content for one experiment (one machine)."""
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": config_distributed_type(spec),
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": spec["world_size"],
        "use_cpu": spec["device"] == "cpu",
        "gpu_ids": "all",
        "mixed_precision": ACCELERATE_MIXED_PRECISION[spec["precision"]],
        # 0: Accelerate asks the OS for a free port at launch, so concurrent jobs never
        # share a rendezvous port (a fixed port would clash, a random one could).
        "main_process_port": 0,
        "rdzv_backend": "static",  # no pickled rendezvous state; its store on loopback (launchers.loopback)
        "main_process_ip": "127.0.0.1",
        "same_network": True,
        "debug": False,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
    }
    if uses_accelerate_fsdp(spec):
        fsdp = spec["fsdp"]
        config["fsdp_config"] = {
            "fsdp_version": 2,
            # The decoder layer class is found from the loaded model by the strategy
            # (distlab.model.decoder_layer_class), never named here.
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": bool(fsdp["reshard_after_forward"]),
            "fsdp_offload_params": bool(fsdp["cpu_offload"]),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }
    return config


def accelerate_command(config_path: str, job_path: str, module: str = "distlab.worker") -> list[str]:
    """`accelerate launch --config_file ... -m <module> --job ...` (module form of the CLI)."""
    # Through distlab.launchers.loopback: the torchrun agent inside accelerate launch binds its
    # rendezvous store to 127.0.0.1 only.
    return [sys.executable, "-m", "distlab.launchers.loopback", "accelerate.commands.launch", "--config_file",
            str(config_path),
            "-m", module, "--job", str(job_path)]


def rerun_environment(spec: dict) -> dict:
    """What a by-hand launch of the saved file needs in its environment. On CPU: the
    torchrun-based launcher does not pass the file's use_cpu to the ranks (accelerate 1.15
    exports ACCELERATE_USE_CPU only from its single-process launcher), so a script that builds a
    plain Accelerator() would see each rank alone (DistributedType.NO, 1 process);
    ACCELERATE_USE_CPU=true makes them one group. distlab's own ranks pass cpu=True themselves."""
    return {"ACCELERATE_USE_CPU": "true"} if spec["device"] == "cpu" else {}


def write_accelerate_config(spec: dict, folder: str | os.PathLike, job_path: str) -> Path:
    path = Path(folder) / CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    env = "".join(f"{name}={value} " for name, value in rerun_environment(spec).items())
    header = ("# Generated by distlab for experiment {id}; the launch read this file.\n"
              "# Rerun by hand from the working directory of that run:\n"
              "#   {env}accelerate launch --config_file {cfg} -m distlab.worker --job {job}\n").format(
        id=spec["id"], env=env, cfg=portable(str(path)), job=portable(str(job_path)))
    if env:
        header += ("# {env}: Accelerate's multi-process launcher does not hand use_cpu below to the ranks;\n"
                   "# without it each rank of another script (accelerate test) would be alone.\n").format(env=env.strip())
    if config_distributed_type(spec) == "MULTI_GPU" and spec["device"] == "cpu":
        header += ("# distributed_type MULTI_GPU selects Accelerate's torchrun-based launcher; with use_cpu\n"
                   "# the ranks run on CPU (gloo) and Accelerate reports MULTI_CPU. A MULTI_CPU file would\n"
                   "# start a single process on one machine (accelerate 1.15 spawns CPU ranks via mpirun).\n")
    path.write_text(header + yaml.safe_dump(accelerate_config(spec), sort_keys=False))
    return path


def launch_environment(spec: dict) -> dict:
    env = single_node_environment(spec)
    for name in [n for n in env if n.startswith("ACCELERATE_")]:
        del env[name]  # the config file, not an inherited variable, decides
    return env


def run(job: dict, job_path: str, log_path: str | None, timeout: float | None) -> None:
    spec = job["spec"]
    config_path = write_accelerate_config(spec, run_files_dir(job["run_dir"]), job_path)
    run_ranks(accelerate_command(str(config_path), job_path), launch_environment(spec), log_path, timeout,
               marker=job_path)

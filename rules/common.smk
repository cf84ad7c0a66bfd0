# Helpers shared by the rules (no rules here). The config is validated and expanded
# into one resolved spec per experiment before any job can start.
import glob
import os
import sys

sys.path.insert(0, workflow.basedir)  # distlab/ works from a checkout without `pip install -e .`

from distlab.config import ConfigError, built_model, load as load_config, validated_experiments
from distlab.finetune_config import resolve_epochs
from distlab.data_checks import datasets_of
from distlab.tokenizer_checks import tokenizer_source
from distlab.hardware import gpu_count, machine_tag
from distlab.run_layout import RUN_FILES
from snakemake.exceptions import WorkflowError

try:
    config, SPECS = load_config(config, probe=True)  # results_dir writable, Ray heads reachable
except ConfigError as error:
    raise WorkflowError(str(error)) from None

RESULTS = config["results_dir"]
MACHINE = machine_tag(config["machine"])
GPUS = gpu_count()  # GPUs present (DISTLAB_GPU_COUNT when planning for another machine)
PREP = f"{RESULTS}/prep"
RUN = f"{RESULTS}/{MACHINE}/{{experiment}}"


wildcard_constraints:
    experiment="[A-Za-z0-9._-]+",
    seq_len="[0-9]+",
    dataset="[a-z0-9][a-z0-9.-]*",
    model_suffix="(|_[a-z0-9][a-z0-9.-]*)",  # "" = the base model, "_<name>" = model.extra.<name>


def tokenizer_path():
    """What encodes the data: data.tokenizer, else the model's own tokenizer (model.path
    folder or model.hub_id), else the BPE the pipeline trains on the corpus for the built model."""
    return tokenizer_source(config) or f"{PREP}/tokenizer/tokenizer.json"


def tokenizer_inputs():
    """The tokenizer as a file input (none for a hub id)."""
    if config["model"]["hub_id"] and not config["data"]["tokenizer"]:
        return []
    return [tokenizer_path()]


def user_model_config():
    """config.json of the user's model folder (its vocab_size and special ids bind the data)."""
    return [os.path.join(config["model"]["path"], "config.json")] if config["model"]["path"] else []


def dataset_config(name):
    """One named dataset's resolved data block (data.extra entries inherit data's keys)."""
    return datasets_of(config["data"])[name]


def model_suffix(name):
    """Path suffix of a model's files: "" for the base model, "_<name>" for model.extra.<name>."""
    return "" if name == "default" else f"_{name}"


def model_config_path(name="default"):
    """config.json of a model: the user's local folder, or the one the pipeline builds."""
    if config["model"]["path"] and name == "default":
        return os.path.join(config["model"]["path"], "config.json")
    return f"{PREP}/model{model_suffix(name)}/config.json"


def model_build(name):
    """The build block of a model the pipeline builds: model.build, or model.extra.<name>'s over it."""
    return config["model"]["build"] if name == "default" else built_model(config, name)


def wildcards_model(wildcards):
    """The model a job uses: its experiment's `model`, else the job's model_suffix wildcard."""
    if hasattr(wildcards, "experiment"):
        return SPECS[wildcards.experiment].get("model", "default")
    return wildcards.model_suffix[1:] or "default"


def model_inputs(wildcards):
    """The job's model config.json as an input, unless it is the base model from the hub by id."""
    name = wildcards_model(wildcards)
    return [] if config["model"]["hub_id"] and name == "default" else [model_config_path(name)]


def model_source(wildcards, input):
    """What from_pretrained loads: the folder of the model's config.json, or the hub id."""
    return os.path.dirname(input.model[0]) if input.model else config["model"]["hub_id"]


def data_dir(wildcards):
    spec = SPECS[wildcards.experiment]
    return f"{PREP}/data/{spec.get('dataset', 'default')}-seq{spec['seq_len']}"


def base_eval_path(wildcards):
    """The base model's held-out eval on this experiment's data (rule evaluate_base_model)."""
    spec = SPECS[wildcards.experiment]
    return (f"{PREP}/eval/base-{spec.get('dataset', 'default')}-seq{spec['seq_len']}"
            f"{model_suffix(spec.get('model', 'default'))}.json")


def experiment_spec(wildcards):
    """Only this experiment's resolved spec: editing another experiment leaves this job alone.
    An `epochs` experiment keeps steps None here (its data may not exist yet, and params must
    not change once it does): distlab.launch resolves them from the prepared data."""
    return SPECS[wildcards.experiment]


def check_epochs_experiments():
    """Epochs experiments whose data is already prepared are checked now, like the others."""
    for spec in SPECS.values():
        folder = f"{PREP}/data/{spec.get('dataset', 'default')}-seq{spec['seq_len']}"
        if spec["steps"] is None and os.path.isfile(f"{folder}/distlab_data.json"):
            try:
                resolve_epochs(spec, folder)
            except ConfigError as error:
                raise WorkflowError(str(error)) from None


check_epochs_experiments()


def on_ray_cluster(spec):
    """Ranks that run on an existing Ray cluster use its cores and GPUs, not this machine's."""
    return spec["launcher"] == "ray" and spec["ray"]["address"] is not None


def rank_cores(spec):
    """Cores per rank: on CPU the device itself; on CUDA the host side of a rank."""
    return spec["cpu_threads_per_rank"] if spec["device"] == "cpu" else config["cuda_cpu_threads_per_rank"]


def experiment_threads(wildcards):
    spec = SPECS[wildcards.experiment]
    if on_ray_cluster(spec):
        return 1
    return spec["world_size"] * rank_cores(spec)


def experiment_gpus(wildcards):
    spec = SPECS[wildcards.experiment]
    return spec["world_size"] if spec["device"] == "cuda" and not on_ray_cluster(spec) else 0


def reshard_world_size(spec):
    """The other world size checkpoint validation loads at: 2 -> 1, 1 -> 2."""
    return 1 if spec["world_size"] > 1 else 2


def validation_threads(wildcards):
    spec = SPECS[wildcards.experiment]
    ranks = max(spec["world_size"], reshard_world_size(spec))
    if spec["device"] == "cuda":
        ranks = min(ranks, GPUS)  # as validation_gpus: a reshard that does not fit is not run
    return ranks * rank_cores(spec)


def validation_gpus(wildcards):
    """At most the GPUs present: where the reshard world size does not fit, validate.py
    records the reshard check as unsupported, with the reason."""
    spec = SPECS[wildcards.experiment]
    return min(max(spec["world_size"], reshard_world_size(spec)), GPUS) if spec["device"] == "cuda" else 0


def this_machine_validations():
    """validation.json of the experiments validation.scope selects: the report waits for them."""
    return expand(f"{RUN}/validation.json", experiment=validated_experiments(config, SPECS))


def this_machine_metrics():
    return expand(f"{RUN}/metrics.json", experiment=list(SPECS))


def this_machine_run_files():
    """Each run's run_files/ (configs the launch generated, pipeline records): the report reads them."""
    return expand(f"{RUN}/{RUN_FILES}", experiment=list(SPECS))


def shared_metrics():
    """metrics.json of every machine folder already under results/ (or extra_results):
    copying another machine's folder in makes the summary and report include it."""
    roots = [RESULTS] + list(config["extra_results"])
    found = []
    for root in roots:
        found += glob.glob(os.path.join(root, "*", "*", "metrics.json"))
    mine = os.path.normpath(os.path.join(RESULTS, MACHINE))
    return sorted(f for f in found if not os.path.normpath(f).startswith(mine + os.sep))


def report_outputs():
    return [f"{RESULTS}/summary.csv", f"{RESULTS}/report/index.html", f"{RESULTS}/report/README.md"]


def validation_check_outputs():
    """The last rule's file: it exists only when every checkpoint validation passed."""
    return [f"{RESULTS}/logs/validations-passed.txt"]


# Planning figures for a scheduler (Slurm's --mem and --time), from the spec: a rank holds the
# model, its optimizer state and a few batches; an explicit memory_budget_gib is the ceiling
# the run is held to. Profiles may override them per rule (set-resources).
RANK_MEM_MB_DEFAULT = 4000
JOB_MEM_MB_OVERHEAD = 1000  # the Snakemake script and the launcher process


def rank_mem_mb(spec):
    budget = spec.get("memory_budget_gib")
    return int(budget * 1024) + 512 if budget else RANK_MEM_MB_DEFAULT


def experiment_mem_mb(wildcards):
    spec = SPECS[wildcards.experiment]
    return JOB_MEM_MB_OVERHEAD if on_ray_cluster(spec) else JOB_MEM_MB_OVERHEAD + spec["world_size"] * rank_mem_mb(spec)


def one_process_model_mem_mb():
    """A single process holding the base model (build, base-model eval): one rank's figure."""
    return JOB_MEM_MB_OVERHEAD + RANK_MEM_MB_DEFAULT


def collectives_mem_mb():
    """The benchmark's ranks: torch, a process group and its largest message twice, each."""
    plan = collectives_plan()
    return JOB_MEM_MB_OVERHEAD + plan["world_size"] * 2000


def validation_mem_mb(wildcards):
    spec = SPECS[wildcards.experiment]
    return JOB_MEM_MB_OVERHEAD + max(spec["world_size"], reshard_world_size(spec)) * rank_mem_mb(spec)


def experiment_runtime(wildcards):
    """Minutes: process start and data loading, plus a generous second per step per repeat."""
    spec = SPECS[wildcards.experiment]
    steps = spec["steps"]
    if steps is None:  # epochs: known once the data exists (a resource cannot wait on a checkpoint)
        folder = data_dir(wildcards)
        steps = resolve_epochs(spec, folder)["steps"] if os.path.isfile(f"{folder}/distlab_data.json") else 3600
    return 10 + (steps * spec.get("repeats", 1)) // 60


def collectives_plan():
    """The bandwidth benchmark's ranks, device and message sizes (rule collectives), sized
    to the GPUs present (distlab.collectives.plan)."""
    from distlab.collectives import plan

    return plan(config["collectives"], SPECS, GPUS)


def collectives_outputs():
    return [f"{RESULTS}/{MACHINE}/collectives.json"] if config["collectives"]["enabled"] else []


def advice_outputs():
    """The advisor needs the model's config.json on disk (not a hub id)."""
    return [] if config["model"]["hub_id"] else [f"{RESULTS}/{MACHINE}/advice.json"]


def ray_experiment_specs():
    """Resolved specs of the experiments Ray Train runs (the KubeRay manifests run them)."""
    return {exp_id: spec for exp_id, spec in SPECS.items() if spec["launcher"] == "ray"}


def kuberay_outputs():
    return [f"{RESULTS}/kuberay/raycluster.yaml", f"{RESULTS}/kuberay/checks.json"] if ray_experiment_specs() else []


# profiles/ray-head: the Ray head's address comes from RAY_ADDRESS; declaring it stops the
# workflow before any job starts when it is missing.
if any(spec["ray"]["address"] == "env" for spec in ray_experiment_specs().values()):

    envvars:
        "RAY_ADDRESS",

# Helpers shared by the rules (no rules here). The config is validated and expanded
# into one resolved spec per experiment before any job can start. What each job asks of the
# machine (threads, memory, runtime): rules/common_resources.smk; the opt-in targets' helpers:
# rules/common_opt_in.smk.
import os
import sys

sys.path.insert(0, workflow.basedir)  # distlab/ works from a checkout without `pip install -e .`

from distlab.configuration.config import OPT_IN_STAGES, ConfigError, built_model, load as load_config
from distlab.configuration.validation_scope import validated_experiments
from distlab.configuration.finetune_config import resolve_epochs
from distlab.configuration.data_checks import datasets_of
from distlab.configuration.tokenizer_checks import tokenizer_source
from distlab.configuration.hardware import gpu_count, machine_tag
from distlab.configuration.results_lock import ResultsFolderBusy, hold_for_workflow
from distlab.records.run_layout import KUBERAY_CHECKS, MACHINE_FILES, RUN_FILES, RUN_SIDE_FILES
from distlab.configuration.tasks.declaration import declaration_for
from distlab.configuration.tasks.causal_lm import CausalLMDeclaration, model_suffix
from distlab.jobs.two_hosts import two_hosts_spec
from distlab.records.job import estimated_runtime_minutes
from distlab.tools.advisor_box import measured_evidence
from distlab.report.collect import shared_metrics_paths
from distlab.records.sharing import private_files
from snakemake.exceptions import WorkflowError

private_files()  # before anything is written: no file of results/ is world-readable (distlab.records.sharing)

try:
    config, SPECS = load_config(config, probe=True)  # results_dir writable, Ray heads reachable
except ConfigError as error:
    raise WorkflowError(str(error)) from None

# The opt-in stages (links, unequal: rules/links.smk) are trained only when their own target asks;
# every default output (metrics, validations, collectives, Ray manifests, report) is of DEFAULT_SPECS.
DEFAULT_SPECS = {exp_id: spec for exp_id, spec in SPECS.items() if spec.stage not in OPT_IN_STAGES}
RESULTS = config["results_dir"]
try:  # before Snakemake can delete any output: one workflow per results folder (distlab.configuration.results_lock)
    hold_for_workflow(RESULTS, workflow)
except ResultsFolderBusy as error:
    raise WorkflowError(str(error)) from None
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


def model_config_path(name="default"):
    """config.json of a causal LM: the user's local folder, or the one the pipeline builds."""
    return CausalLMDeclaration.model_config_path(config, name, PREP)


def model_build(name):
    """The build block of a model the pipeline builds: model.build, or model.extra.<name>'s over it."""
    return config["model"]["build"] if name == "default" else built_model(config, name)


def wildcards_model(wildcards):
    """The model of a base-model eval job: its model_suffix wildcard."""
    return wildcards.model_suffix[1:] or "default"


def model_inputs(wildcards):
    """The job's model file as an input (its task's: config.json, model_index.json), unless it is
    the base model from the hub by id."""
    if hasattr(wildcards, "experiment"):
        spec = SPECS[wildcards.experiment]
        found = declaration_for(spec).model_file(spec, config, PREP)
        return [found] if found else []
    name = wildcards_model(wildcards)
    return [] if config["model"]["hub_id"] and name == "default" else [model_config_path(name)]


def model_source(wildcards, input):
    """What from_pretrained loads: the folder of the model's config.json, or the hub id."""
    return os.path.dirname(input.model[0]) if input.model else config["model"]["hub_id"]


def data_dir(wildcards):
    """The prepared data the experiment's task reads (causal LM: <dataset>-seq<N>)."""
    spec = SPECS[wildcards.experiment]
    return declaration_for(spec).data_dir(spec, PREP)


def base_eval_path(wildcards):
    """The base model's held-out eval on this experiment's data (rule evaluate_base_model, or its task's)."""
    spec = SPECS[wildcards.experiment]
    return declaration_for(spec).base_eval_path(spec, PREP)


def experiment_spec(wildcards):
    """Only this experiment's resolved spec: editing another experiment leaves this job alone.
    An `epochs` experiment keeps steps None here (its data may not exist yet, and params must
    not change once it does): distlab.jobs.launch resolves them from the prepared data."""
    return SPECS[wildcards.experiment]


def check_epochs_experiments():
    """Epochs experiments whose data is already prepared are checked now, like the others."""
    for spec in SPECS.values():
        folder = f"{PREP}/data/{spec.dataset}-seq{spec.seq_len}"
        if spec.steps is None and os.path.isfile(f"{folder}/distlab_data.json"):
            try:
                resolve_epochs(spec, folder)
            except ConfigError as error:
                raise WorkflowError(str(error)) from None


check_epochs_experiments()


def start_warm_start_server():
    """onstart: this run's warm-start server (distlab.launchers.warm_start), when config
    warm_start is on, a CPU experiment is in the run and its jobs run on this machine (not a
    cluster executor: a job elsewhere would find no server and start fresh); its socket reaches
    every job through the environment they inherit (ranks of CPU launches only:
    distlab.launchers.environment). A socket inherited from another run is never offered."""
    from distlab.launchers import warm_start
    from distlab.launchers.environment import warm_start_environment

    wanted = config["warm_start"] and workflow.local_exec and starts_cpu_ranks()
    try:
        warm_start.start_run_server(wanted, warm_start_environment(), f"{RESULTS}/logs/warm-start.log")
    except OSError as error:  # each rank then starts fresh and its timeline says so
        print(f"distlab: no warm-start server ({error}); every rank starts fresh", file=sys.stderr)


def starts_cpu_ranks():
    """Whether this run has a job that starts CPU ranks (a run that only prepares data, or
    trains only on GPUs or a Ray cluster, would pay the server's imports for nothing)."""
    try:
        jobs = list(workflow.dag.needrun_jobs())
    except AttributeError:  # another Snakemake's DAG: assume it does
        return True
    launches = {"train", "validate_checkpoint", "collectives"}
    for job in jobs:
        experiment = getattr(job.wildcards, "experiment", None)
        if job.rule.name in launches and (experiment is None or SPECS[experiment]["device"] == "cpu"):
            return True
    return False


def stop_warm_start_server():
    """onsuccess / onerror: the server this run started goes (it would die with snakemake
    anyway), and only the files it made; nothing of a server this run did not start."""
    from distlab.launchers import warm_start

    warm_start.stop_run_server()


def this_machine_validations():
    """validation.json of the experiments validation.scope selects: the report waits for them."""
    return expand(f"{RUN}/validation.json", experiment=validated_experiments(config, DEFAULT_SPECS))


def this_machine_metrics():
    return expand(f"{RUN}/metrics.json", experiment=list(DEFAULT_SPECS))


# metrics.json of every machine folder already under results/ (or extra_results): copying another
# machine's folder in makes the summary and report include it. A folder whose name Snakemake would
# read as a wildcard is ignored, named here and in the summary's and report's files left out.
SHARED_METRICS, IGNORED_RESULTS = shared_metrics_paths(
    [RESULTS] + list(config["extra_results"]), os.path.join(RESULTS, MACHINE)
)
for _ignored in IGNORED_RESULTS:
    print(f"WARNING: {_ignored['reason']}", file=sys.stderr)


def shared_metrics():
    return SHARED_METRICS


TRAIN_SIDE_FILES = [name for name in RUN_SIDE_FILES if name != "validation.json"]  # rule train writes them


def runs_side_files():
    """What the summary and the report read beside each run's metrics.json (RUN_SIDE_FILES: steps,
    devices, the job's benchmark record, run_files/ with its pipeline records and sample grid):
    their scripts read no file they do not declare. This machine's come from rule train
    (validation.json: this_machine_validations); a copied-in machine's are those its folder holds."""
    mine = expand(f"{RUN}/{{name}}", experiment=list(DEFAULT_SPECS), name=TRAIN_SIDE_FILES)
    beside = [os.path.join(os.path.dirname(m), name) for m in shared_metrics() for name in RUN_SIDE_FILES]
    return mine + [path for path in beside if os.path.exists(path)]


def shared_machine_files():
    """A copied-in machine's hardware.json, collectives.json, advice*.json (MACHINE_FILES) and its
    results folder's kuberay/checks.json, those present: the report reads them. This machine's come
    from their rules (hardware, collectives_outputs, advice_outputs, sd_advice_outputs, kuberay_outputs)."""
    machines = sorted({os.path.dirname(os.path.dirname(m)) for m in shared_metrics()})
    roots = {os.path.normpath(os.path.dirname(d)) for d in machines} - {os.path.normpath(RESULTS)}
    found = [os.path.join(d, name) for d in machines for name in MACHINE_FILES]
    found += [os.path.join(root, KUBERAY_CHECKS) for root in sorted(roots)]
    return [path for path in found if os.path.isfile(path)]


def report_outputs():
    return [f"{RESULTS}/summary.csv", f"{RESULTS}/report/index.html", f"{RESULTS}/report/README.md"]


def validation_check_outputs():
    """The last rule's file: it exists only when every checkpoint validation passed."""
    return [f"{RESULTS}/logs/validations-passed.txt"]


def collectives_outputs():
    return [f"{RESULTS}/{MACHINE}/collectives.json"] if config["collectives"]["enabled"] else []


def advice_outputs():
    """The advisor sizes the causal LM (model block) from its config.json on disk (not a hub id):
    only when an experiment fine-tunes it (a text-to-image-only config builds no LM)."""
    if config["model"]["hub_id"] or not any(spec.task == "causal-lm" for spec in SPECS.values()):
        return []
    return [f"{RESULTS}/{MACHINE}/advice.json"]


def sd_model_inputs():
    """model_index.json of the text-to-image task's model: text_to_image.model.path, or the built tiny SD."""
    path = config["text_to_image"]["model"]["path"]
    return [os.path.join(path, "model_index.json")] if path else [f"{PREP}/sd-model/model_index.json"]


def sd_advice_outputs():
    """advice-sd.json, written by advise_sd when an experiment runs the text-to-image task (its card reads it)."""
    if not any(spec.task == "text-to-image" for spec in SPECS.values()):
        return []
    return [f"{RESULTS}/{MACHINE}/advice-sd.json"]


def ray_experiment_specs():
    """Resolved specs of the experiments Ray Train runs (the KubeRay manifests run them)."""
    return {exp_id: spec for exp_id, spec in DEFAULT_SPECS.items() if spec.launcher == "ray"}


def kuberay_outputs():
    return [f"{RESULTS}/kuberay/raycluster.yaml", f"{RESULTS}/kuberay/checks.json"] if ray_experiment_specs() else []


# profiles/ray-head: the Ray head's address comes from RAY_ADDRESS; declaring it stops the
# workflow before any job starts when it is missing.
if any(spec.ray["address"] == "env" for spec in ray_experiment_specs().values()):

    envvars:
        "RAY_ADDRESS",


# The step-time prediction (distlab.tools.step_time): every causal-LM run on a model whose
# config.json is on disk is predicted before it trains, from the compute probe of its kernels'
# shapes and the collectives benchmark of the links its ranks use.
def predicted(spec):
    return spec.task == "causal-lm" and model_config_path(spec.model) is not None


def prediction_inputs(wildcards):
    """The probe and the collectives file a run's prediction reads. The probe's name holds all it
    depends on, so it never reruns for another experiment. ancient(collectives): re-measuring the
    links reruns no experiment."""
    from distlab.tools.step_time import probe_key

    spec = SPECS[wildcards.experiment]
    if not predicted(spec):
        return {}
    found = {"probe": f"{RESULTS}/{MACHINE}/compute_probe/{spec.model}/{probe_key(spec)}.json"}
    if spec.world_size > 1:
        from distlab.configuration.config_links import link_label

        if spec.link:
            found["collectives"] = ancient(
                f"{RESULTS}/{MACHINE}/links/collectives-{link_label(spec.link['bandwidth_mbit'])}.json"
            )
        elif collectives_outputs():
            found["collectives"] = ancient(collectives_outputs()[0])
    return found

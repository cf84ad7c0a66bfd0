# Helpers shared by the rules (no rules here): what each job asks of the machine or a scheduler:
# threads, GPUs, memory and runtime, from the experiment's spec.


def on_ray_cluster(spec):
    """Ranks that run on an existing Ray cluster use its cores and GPUs, not this machine's."""
    return spec.launcher == "ray" and spec.ray["address"] is not None


def rank_cores(spec):
    """Cores per rank: on CPU the device itself; on CUDA the host side of a rank."""
    return spec.cpu_threads_per_rank if spec.device == "cpu" else config["cuda_cpu_threads_per_rank"]


def experiment_threads(wildcards):
    spec = SPECS[wildcards.experiment]
    if on_ray_cluster(spec):
        return 1
    if spec.device == "cpu" and spec.rank_cpu_threads:  # unequal CPU devices: their sum
        return sum(spec.rank_cpu_threads)
    return spec.world_size * rank_cores(spec)


def eval_threads(wildcards):
    """The base-model eval of one dataset, seq_len and model: as many cores as one rank of the
    experiments it serves gets (rank_cores), at least 1."""
    served = [
        spec
        for spec in SPECS.values()
        if spec.dataset == wildcards.dataset
        and str(spec.seq_len) == wildcards.seq_len
        and model_suffix(spec.model) == wildcards.model_suffix
    ]
    return max([rank_cores(spec) for spec in served], default=1)


def experiment_gpus(wildcards):
    spec = SPECS[wildcards.experiment]
    return spec.world_size if spec.device == "cuda" and not on_ray_cluster(spec) else 0


def reshard_world_size(spec):
    """The other world size checkpoint validation loads at: 2 -> 1, 1 -> 2."""
    return 1 if spec.world_size > 1 else 2


def validation_threads(wildcards):
    spec = SPECS[wildcards.experiment]
    ranks = max(spec.world_size, reshard_world_size(spec))
    if spec.device == "cuda":
        ranks = min(ranks, GPUS)  # as validation_gpus: a reshard that does not fit is not run
    return ranks * rank_cores(spec)


def validation_gpus(wildcards):
    """At most the GPUs present: where the reshard world size does not fit, validate.py
    records the reshard check as unsupported, with the reason."""
    spec = SPECS[wildcards.experiment]
    return min(max(spec.world_size, reshard_world_size(spec)), GPUS) if spec.device == "cuda" else 0


# Planning figures for a scheduler (Slurm's --mem and --time), from the spec: a rank holds the
# model, its optimizer state and a few batches; an explicit memory_budget_gib is the ceiling
# the run is held to. Profiles may override them per rule (set-resources).
RANK_MEM_MB_DEFAULT = 4000
JOB_MEM_MB_OVERHEAD = 1000  # the Snakemake script and the launcher process


def rank_mem_mb(spec):
    budget = spec.memory_budget_gib
    return int(budget * 1024) + 512 if budget else RANK_MEM_MB_DEFAULT


def experiment_mem_mb(wildcards):
    spec = SPECS[wildcards.experiment]
    return JOB_MEM_MB_OVERHEAD if on_ray_cluster(spec) else JOB_MEM_MB_OVERHEAD + spec.world_size * rank_mem_mb(spec)


def one_process_model_mem_mb():
    """A single process holding the base model (build, base-model eval): one rank's figure."""
    return JOB_MEM_MB_OVERHEAD + RANK_MEM_MB_DEFAULT


def collectives_mem_mb():
    """The benchmark's ranks: torch, a process group and its largest message twice, each."""
    plan = collectives_plan()
    return JOB_MEM_MB_OVERHEAD + plan["world_size"] * 2000


def validation_mem_mb(wildcards):
    spec = SPECS[wildcards.experiment]
    return JOB_MEM_MB_OVERHEAD + max(spec.world_size, reshard_world_size(spec)) * rank_mem_mb(spec)


def experiment_runtime(wildcards, rule="train"):
    """Minutes: job_runtime_minutes.<rule> when the config sets it (the GPU kit's time plan),
    else process start and data loading plus a generous second per step per repeat."""
    planned = config["job_runtime_minutes"][rule]
    if planned is not None:
        return planned
    spec = SPECS[wildcards.experiment]
    steps = spec.steps
    if steps is None:  # epochs: known once the data exists (a resource cannot wait on a checkpoint)
        folder = data_dir(wildcards)
        steps = resolve_epochs(spec, folder)["steps"] if os.path.isfile(f"{folder}/distlab_data.json") else 3600
    return estimated_runtime_minutes(spec, steps)


def validation_runtime(wildcards):
    return experiment_runtime(wildcards, rule="validate")


def collectives_plan():
    """The bandwidth benchmark's ranks, device and message sizes (rule collectives), sized
    to the GPUs present (distlab.tools.collectives.plan)."""
    from distlab.tools.collectives import plan

    return plan(config["collectives"], DEFAULT_SPECS, GPUS)

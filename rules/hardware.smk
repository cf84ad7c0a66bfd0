# What this machine has and can do: its matmul peak (hardware), the kernels of each run's shapes
# (compute_probe) and which of them a run's step-time prediction reads (prediction_inputs).


rule hardware:
    output:
        f"{RESULTS}/{MACHINE}/hardware.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/hardware.log",
    conda:
        "../envs/train.yaml"
    threads: workflow.cores
    resources:
        # A probe: device queries and a short CPU matmul peak measurement.
        mem_mb=2000,
        runtime=10,
    params:
        machine=config["machine"],
    script:
        "../scripts/hardware.py"


# The compute probe: the kernels of one probe key (device, dtype, threads, micro-batch rows x
# sequence, tensor-parallel degree, 4-bit weights: distlab.tools.step_time.probe_key) at one
# model's shapes, timed for the step-time prediction. All cores: it times kernels, so it runs
# alone, as the hardware rule's peak does. Experiments of one key share it.
rule compute_probe:
    input:
        model=lambda wildcards: model_config_path(wildcards.model),
    output:
        f"{RESULTS}/{MACHINE}/compute_probe/{{model}}/{{key}}.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/compute_probe-{{model}}-{{key}}.log",
    benchmark:
        f"{RESULTS}/{MACHINE}/logs/compute_probe-{{model}}-{{key}}.benchmark.tsv"
    wildcard_constraints:
        key=r"(cpu|cuda)-\w+-t\d+-r\d+x\d+-tp\d+(-nf4)?",
    conda:
        "../envs/train.yaml"
    threads: workflow.cores
    resources:
        # CUDA keys' kernels are timed on one GPU.
        gpu=lambda wildcards: int(wildcards.key.startswith("cuda")),
        mem_mb=one_process_model_mem_mb(),
        runtime=1,  # seconds of kernels after the imports
    script:
        "../scripts/compute_probe.py"


# The step-time prediction (distlab.tools.step_time): every causal-LM run on a model whose
# config.json is on disk is predicted before it trains, from the compute probe of its kernels'
# shapes and the collectives benchmark of the links its ranks use.
def predicted(spec):
    return spec["task"] == "causal-lm" and model_config_path(spec.get("model", "default")) is not None


def prediction_inputs(wildcards):
    """The probe and the collectives file a run's prediction reads. The probe's name holds all it
    depends on, so it never reruns for another experiment. ancient(collectives): re-measuring the
    links reruns no experiment."""
    from distlab.tools.step_time import probe_key

    spec = SPECS[wildcards.experiment]
    if not predicted(spec):
        return {}
    found = {"probe": f"{RESULTS}/{MACHINE}/compute_probe/{spec.get('model', 'default')}/{probe_key(spec)}.json"}
    if spec["world_size"] > 1:
        from distlab.configuration.config_links import link_label

        if spec["link"]:
            found["collectives"] = ancient(
                f"{RESULTS}/{MACHINE}/links/collectives-{link_label(spec['link']['bandwidth_mbit'])}.json"
            )
        elif collectives_outputs():
            found["collectives"] = ancient(collectives_outputs()[0])
    return found

# The advisor: which strategy to run on this hardware, from hardware.json and the model's
# config.json alone (`snakemake advise`). The report checks it against the measured runs.


rule advise:
    input:
        hardware=f"{RESULTS}/{MACHINE}/hardware.json",
        model=model_config_path(),
        # interconnect: measured classifies the link by this machine's all-reduce busbw.
        collectives=collectives_outputs() if config["advisor"]["interconnect"] == "measured" else [],
    output:
        json=f"{RESULTS}/{MACHINE}/advice.json",
        md=report(
            f"{RESULTS}/{MACHINE}/advice.md",
            category="Advisor",
            labels={"page": "strategy advice", "machine": MACHINE},
        ),
    log:
        f"{RESULTS}/{MACHINE}/logs/advise.log",
    conda:
        "../envs/report.yaml"
    resources:
        # Arithmetic on the model's config.json and hardware.json; no model is loaded.
        mem_mb=1000,
        runtime=5,
    params:
        advisor=config["advisor"],
        defaults=config["defaults"],
        cpu_ranks=max([1] + [spec.world_size for spec in DEFAULT_SPECS.values()]),
        # The measured cards (`snakemake links`, `unequal`) as evidence, when they exist: their
        # content, not their files, so the default run never asks for those targets.
        evidence=measured_evidence(f"{RESULTS}/{MACHINE}"),
    script:
        "../scripts/advise.py"

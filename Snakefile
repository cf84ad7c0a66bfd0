# distlab: the distributed-training roadmap as one reproducible experiment pipeline.
# Stages chain: data prep -> base model -> one job per experiment -> summary -> report.
import sys

from snakemake.utils import min_version

min_version("9.0")
sys.path.insert(0, workflow.basedir)  # distlab/ works from a checkout without `pip install -e .`

from distlab.configuration.input_checks import check_config_syntax

# The embedded default. A config file given with --configfile (a preset, the GPU kit) is a
# whole config and replaces it rather than merging: merged, their stages would add up.
# --config key=value still edits the default.
if not workflow.overwrite_configfiles:
    # Snakemake's own message for a YAML syntax error names neither the file nor the line.
    check_config_syntax("config/config.yaml")

    configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/common_resources.smk"
include: "rules/common_opt_in.smk"
include: "rules/data.smk"
include: "rules/model.smk"
include: "rules/eval.smk"
include: "rules/text_to_image.smk"
include: "rules/hardware.smk"
include: "rules/train.smk"
include: "rules/validate.smk"
include: "rules/report.smk"
include: "rules/bench.smk"
include: "rules/advise.smk"
include: "rules/kuberay.smk"
include: "rules/links.smk"


# CPU ranks fork from one warm interpreter per run (config warm_start; distlab.launchers.warm_start).
onstart:
    start_warm_start_server()


onsuccess:
    stop_warm_start_server()


onerror:
    stop_warm_start_server()


# Light rules run where Snakemake runs, never as cluster jobs (profiles/slurm).
localrules:
    all,
    summary,
    report,
    check_validations,
    advise,
    kuberay,
    hardware,


rule all:
    default_target: True
    input:
        report_outputs(),
        kuberay_outputs(),
        validation_check_outputs(),

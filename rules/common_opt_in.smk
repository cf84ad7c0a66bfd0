# Helpers of the opt-in targets (rules/links.smk: links, unequal, two_hosts; no rules here):
# their experiments, the refusals where this machine cannot run them, the link caps.


def stage_specs(stage):
    return {exp_id: spec for exp_id, spec in SPECS.items() if spec.stage == stage}


def refuse_where_this_machine_cannot(specs, target):
    """Stop before any job when the machine cannot give these experiments what they ask (root
    for network namespaces or CPU budgets), naming the experiment, the field and why."""
    from distlab.configuration.config_links import machine_refusal

    problems = [
        f"experiment {exp_id}, field '{refused[0]}': {refused[1]}"
        for exp_id, spec in specs.items()
        if (refused := machine_refusal(spec))
    ]
    if problems:
        raise WorkflowError(f"`snakemake {target}` cannot run on this machine:\n  " + "\n  ".join(problems))


def stage_metrics(stage):
    """Input function of an opt-in target: its stage's metrics. Called only when the target is
    asked for, so the default run never needs what the stage needs."""

    def metrics(wildcards):
        specs = stage_specs(stage)
        if not specs:
            raise WorkflowError(
                f"config field 'stages.{stage}': no enabled experiment; `snakemake {stage}` has nothing to run"
            )
        refuse_where_this_machine_cannot(specs, stage)
        return expand(f"{RUN}/metrics.json", experiment=list(specs))

    return metrics


def stage_side_files(stage):
    """What an opt-in target's page reads beside each of its stage's runs (rule train's side files)."""
    return lambda wildcards: expand(f"{RUN}/{{name}}", experiment=list(stage_specs(stage)), name=TRAIN_SIDE_FILES)


def link_caps():
    """{id label: Mbit/s} of the links stage's caps (link_label: 100m, 1g, free)."""
    from distlab.configuration.config_links import link_label

    return {
        link_label(spec.link["bandwidth_mbit"]): spec.link["bandwidth_mbit"]
        for spec in stage_specs("links").values()
        if spec.link
    }


LINK_CAPS = link_caps()
# Under a link the largest message is 4 MiB: at 100 Mbit/s one all-reduce of it takes ~0.3 s.
LINK_COLLECTIVES_MAX_BYTES = 4 << 20


def link_collectives_plan():
    from distlab.tools.collectives import plan

    found = plan(config["collectives"], {}, 0)  # gloo on 2 CPU ranks, one per host
    return dict(found, max_bytes=min(found["max_bytes"], LINK_COLLECTIVES_MAX_BYTES))


try:
    TWO_HOSTS_SPEC = two_hosts_spec(config)
except ConfigError as error:
    raise WorkflowError(str(error)) from None


def two_hosts_input(kind):
    """Input function of rule two_hosts (refuses, before any job, where links cannot be made)."""

    def path(wildcards):
        spec = TWO_HOSTS_SPEC
        if kind == "data":
            from distlab.configuration.netns import refusal

            if refusal():
                raise WorkflowError(
                    f"`snakemake two_hosts` cannot run on this machine: network namespaces cannot "
                    f"be made here: {refusal()}"
                )
            return f"{PREP}/data/{spec.dataset}-seq{spec.seq_len}"
        if kind == "model":
            return [model_config_path(spec.model)]
        return f"{PREP}/eval/base-{spec.dataset}-seq{spec.seq_len}" f"{model_suffix(spec.model)}.json"

    return path

# What the link and unequal devices do: three opt-in targets, none part of the default run.
#   snakemake --cores all links      the stage `links` experiments at each link cap + collectives per cap -> card
#   snakemake --cores all unequal    the stage `unequal` experiments (uniform vs sized batches)           -> card
#   snakemake --cores all two_hosts  a Ray head and a worker node on two namespaced hosts, elastic run    -> card
# Links and two hosts need root (network namespaces); the config check names why where they cannot run.


rule link_collectives:
    output:
        f"{RESULTS}/{MACHINE}/links/collectives-{{cap}}.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/link-collectives-{{cap}}.log",
    benchmark:
        f"{RESULTS}/{MACHINE}/logs/link-collectives-{{cap}}.benchmark.tsv"
    conda:
        "../envs/train.yaml"
    threads: 2
    resources:
        mem_mb=collectives_mem_mb(),
        runtime=20,  # the slowest cap carries every message size's calls: minutes
    params:
        plan=link_collectives_plan(),
        bandwidth_mbit=lambda wildcards: LINK_CAPS[wildcards.cap],
        machine=MACHINE,
        timeout_s=900,
    script:
        "../scripts/link_collectives.py"


rule links:
    input:
        metrics=stage_metrics("links"),
        beside=stage_side_files("links"),  # steps, devices, run_files/ ...: the page reads them
        collectives=expand(f"{RESULTS}/{MACHINE}/links/collectives-{{cap}}.json", cap=list(LINK_CAPS)),
    output:
        html=f"{RESULTS}/{MACHINE}/links/index.html",
        readme=f"{RESULTS}/{MACHINE}/links/README.md",
        json=f"{RESULTS}/{MACHINE}/links/card.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/links-card.log",
    conda:
        "../envs/report.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/stage_card.py"


rule unequal:
    input:
        metrics=stage_metrics("unequal"),
        beside=stage_side_files("unequal"),  # steps, devices, run_files/ ...: the page reads them
    output:
        html=f"{RESULTS}/{MACHINE}/unequal/index.html",
        readme=f"{RESULTS}/{MACHINE}/unequal/README.md",
        json=f"{RESULTS}/{MACHINE}/unequal/card.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/unequal-card.log",
    conda:
        "../envs/report.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/stage_card.py"


rule two_hosts:
    input:
        data=two_hosts_input("data"),
        model=two_hosts_input("model"),
        hardware=f"{RESULTS}/{MACHINE}/hardware.json",
        base_eval=two_hosts_input("base_eval"),
    output:
        metrics=f"{RESULTS}/{MACHINE}/two-hosts/metrics.json",
        steps=f"{RESULTS}/{MACHINE}/two-hosts/steps.jsonl",
        checkpoint=directory(f"{RESULTS}/{MACHINE}/two-hosts/checkpoint"),
        hosts=f"{RESULTS}/{MACHINE}/two-hosts/hosts.json",
        html=f"{RESULTS}/{MACHINE}/two-hosts/index.html",
        readme=f"{RESULTS}/{MACHINE}/two-hosts/README.md",
    log:
        f"{RESULTS}/{MACHINE}/two-hosts/train.log",
    benchmark:
        f"{RESULTS}/{MACHINE}/two-hosts/benchmark.tsv"
    conda:
        "../envs/train.yaml"
    threads: 2
    resources:
        mem_mb=JOB_MEM_MB_OVERHEAD + 2 * RANK_MEM_MB_DEFAULT,
        runtime=30,
    params:
        spec=TWO_HOSTS_SPEC,
        bandwidth_mbit=config["two_hosts"]["bandwidth_mbit"],
        model_source=lambda wildcards, input: os.path.dirname(input.model[0]),
        env_allowlist=config["env_allowlist"],
        timeout_s=1800,
    script:
        "../scripts/two_hosts.py"

# Aggregation: every machine's runs -> summary.csv -> the milestone report -> the check
# that every checkpoint validation passed.


rule summary:
    input:
        mine=this_machine_metrics(),
        shared=shared_metrics(),
        # checkpoint_validation is read from these: declared, so the summary waits for them.
        validations=this_machine_validations(),
        beside=runs_side_files(),  # steps, devices, run_files/ ...: scripts/summary.py reads no other file
    output:
        csv=report(
            f"{RESULTS}/summary.csv",
            caption="../report/summary.rst",
            category="Summary",
            labels={"table": "all runs"},
        ),
        rejected=f"{RESULTS}/summary-rejected.json",
    log:
        f"{RESULTS}/logs/summary.log",
    conda:
        "../envs/report.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        ignored=IGNORED_RESULTS,  # folders that cannot be inputs, named beside the files left out
    script:
        "../scripts/summary.py"


rule report:
    input:
        summary=f"{RESULTS}/summary.csv",
        metrics=this_machine_metrics() + shared_metrics(),
        beside=runs_side_files(),  # steps, devices, run_files/ ...: scripts/report.py reads no other file
        validations=this_machine_validations(),
        hardware=f"{RESULTS}/{MACHINE}/hardware.json",
        shared_machines=shared_machine_files(),
        collectives=collectives_outputs(),
        advice=advice_outputs(),
        sd_advice=sd_advice_outputs(),  # read by the text-to-image card, beside its runs
        kuberay=kuberay_outputs(),
    output:
        html=report(
            f"{RESULTS}/report/index.html",
            caption="../report/milestones.rst",
            category="Report",
            labels={"page": "milestones"},
        ),
        readme=report(
            f"{RESULTS}/report/README.md",
            caption="../report/milestones.rst",
            category="Report",
            labels={"page": "milestones (markdown)"},
        ),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../envs/report.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        ignored=IGNORED_RESULTS,
    script:
        "../scripts/report.py"


# Last: the report is built whatever the validations say; then a failed one fails the workflow.
rule check_validations:
    input:
        report=report_outputs(),
        validations=this_machine_validations(),
    output:
        f"{RESULTS}/logs/validations-passed.txt",
    log:
        f"{RESULTS}/logs/check_validations.log",
    conda:
        "../envs/report.yaml"
    resources:
        mem_mb=500,
        runtime=5,
    script:
        "../scripts/check_validations.py"

# Aggregation: every machine's runs -> summary.csv -> the milestone report.


rule summary:
    input:
        mine=this_machine_metrics(),
        shared=shared_metrics(),
    output:
        report(f"{RESULTS}/summary.csv", category="Summary", labels={"table": "all runs"}),
    log:
        f"{RESULTS}/logs/summary.log",
    conda:
        "../envs/report.yaml"
    script:
        "../scripts/summary.py"


rule report:
    input:
        summary=f"{RESULTS}/summary.csv",
        metrics=this_machine_metrics() + shared_metrics(),
        validations=this_machine_validations(),
        collectives=collectives_outputs(),
        advice=advice_outputs(),
        kuberay=kuberay_outputs(),
    output:
        html=report(f"{RESULTS}/report/index.html", category="Report", labels={"page": "milestones"}),
        readme=report(f"{RESULTS}/report/README.md", category="Report", labels={"page": "milestones (markdown)"}),
    log:
        f"{RESULTS}/logs/report.log",
    conda:
        "../envs/report.yaml"
    script:
        "../scripts/report.py"

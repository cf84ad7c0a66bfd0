"""Rule two_hosts: a Ray head and a worker node on two namespaced hosts, one elastic Ray Train
run across both with the worker node leaving and rejoining (distlab/jobs/two_hosts.py), then its card."""
import json
import os
from pathlib import Path

from distlab.jobs.launch import rule_job
from distlab.report.inputs import declared_inputs
from distlab.report.pages import two_hosts_page
from distlab.jobs.rule_log import logged
from distlab.jobs.two_hosts import run_two_hosts

with logged(snakemake):
    run_dir = os.path.dirname(snakemake.output.metrics)
    job = rule_job(snakemake, run_dir)
    record = run_two_hosts(job, snakemake.params.bandwidth_mbit, log_path=None, timeout=snakemake.params.timeout_s)
    Path(snakemake.output.hosts).write_text(json.dumps(record, indent=1))
    out = snakemake.output  # the page reads this job's own records, not a benchmark.tsv of an earlier run
    two_hosts_page(out.metrics, out.hosts, out.html, out.readme, declared_inputs([out.metrics, out.steps, out.hosts]))

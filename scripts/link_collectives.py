"""Rule link_collectives: the collective bandwidth benchmark with each rank on its own host
of a capped link (distlab/launchers/links.py), one torchrun agent per host."""
import json
import os

from distlab.tools.collectives import command_args, rank_spec
from distlab.launchers.environment import rank_environment
from distlab.launchers.linked import run_on_link
from distlab.launchers.links import LinkedHosts
from distlab.jobs.rule_log import logged

with logged(snakemake):
    plan, out = dict(snakemake.params.plan), snakemake.output[0]
    env = rank_environment(rank_spec(plan))  # the rank service's rules; gloo on CPU tensors (plan device cpu)
    with LinkedHosts(plan["world_size"], snakemake.params.bandwidth_mbit) as hosts:
        link = run_on_link(hosts, "distlab.tools.collectives", command_args(plan, os.path.abspath(out),
                                                                            snakemake.params.machine),
                           env, None, timeout=snakemake.params.timeout_s)  # output: the rule log (fd 1)
    result = json.loads(open(out).read())
    result["link"] = link  # the link it ran over, and the bytes each host moved
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)

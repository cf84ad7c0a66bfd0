"""Rule collectives: start the bandwidth benchmark's ranks (torchrun) on this machine, through
the service training uses (distlab.launchers.process.run_ranks): they die with this job."""
import os

from distlab.collectives import command_args
from distlab.gpu_alloc import allocate, lock_dir_for
from distlab.launchers import loopback
from distlab.launchers.environment import BASE_ENV
from distlab.launchers.process import launch_line, run_ranks
from distlab.launchers.torchrun import torchrun_command
from distlab.rule_log import logged

with logged(snakemake):
    plan = dict(snakemake.params.plan)
    out = snakemake.output[0]
    cmd = torchrun_command(plan["world_size"], "distlab.collectives", *command_args(plan, out, snakemake.params.machine))
    env = dict(os.environ, **BASE_ENV, **loopback.environment(), OMP_NUM_THREADS="1")
    print(launch_line(cmd), end="", flush=True)

    def start_ranks():
        # No timeout, as for training: the rule's runtime is the scheduler's. Output goes to the rule's log.
        run_ranks(cmd, env, None, None, marker=os.path.abspath(out), what="collective benchmark ranks")

    if plan["device"] == "cuda":
        with allocate(plan["world_size"], lock_dir_for(os.path.dirname(os.path.dirname(os.path.abspath(out))))) as ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            print(f"GPUs held: {ids}", flush=True)
            start_ranks()
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU tensors only
        start_ranks()

"""Rule collectives: start the bandwidth benchmark's ranks (torchrun) on this machine."""
import os
import subprocess

from distlab.gpu_alloc import allocate, lock_dir_for
from distlab.launchers import loopback
from distlab.launchers.environment import BASE_ENV
from distlab.launchers.torchrun import torchrun_command
from distlab.rule_log import logged

with logged(snakemake):
    plan = dict(snakemake.params.plan)
    out = snakemake.output[0]
    cmd = torchrun_command(plan["world_size"], "distlab.collectives",
                           "--out", out, "--device", plan["device"], "--machine", snakemake.params.machine,
                           "--min-bytes", str(plan["min_bytes"]), "--max-bytes", str(plan["max_bytes"]),
                           "--factor", str(plan["factor"]), "--iters", str(plan["iters"]), "--warmup", str(plan["warmup"]))
    if plan["nccl_skipped"]:
        cmd += ["--nccl-skipped", plan["nccl_skipped"]]
    env = dict(os.environ, **BASE_ENV, **loopback.environment(), OMP_NUM_THREADS="1")
    print("$ " + " ".join(cmd), flush=True)
    if plan["device"] == "cuda":
        with allocate(plan["world_size"], lock_dir_for(os.path.dirname(os.path.dirname(os.path.abspath(out))))) as ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            print(f"GPUs held: {ids}", flush=True)
            subprocess.run(cmd, env=env, check=True)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU tensors only
        subprocess.run(cmd, env=env, check=True)

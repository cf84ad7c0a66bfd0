"""The advisor's estimate vs the model state each rank measured, per strategy, on the tests'
tiny model: runs each default-config strategy shape for 3 steps (distlab.testing.run_experiment)
and prints advisor.check_against_runs' row and rank 0's measured parts (MiB).

    nice -n 10 python benchmarks/advisor_check.py [case ...]      # benchmarks/RESULTS.md, docs/advisor.md

Runs are kept under $ADVISOR_CHECK_DIR (default /tmp/distlab-advisor-check) and reused."""
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")
WORK = Path(os.environ.get("ADVISOR_CHECK_DIR", "/tmp/distlab-advisor-check"))
from distlab.tools import advisor, advisor_check
from distlab.records.run_outputs import read_run_record
from distlab.testing import build_prepared, resolve, run_experiment

root = WORK / "prep"
if not (root / "model").exists():
    build_prepared(root)

base = dict(steps=3, untimed_steps=1)
CASES = {
 "ddp-w1": ({"strategy": "ddp", "world_size": 1, "micro_batch": 2}, "ddp"),
 "ddp-w2": ({"strategy": "ddp", "world_size": 2, "micro_batch": 2}, "ddp"),
 "acc-lora-w1": ({"strategy": "accelerate", "method": "lora", "world_size": 1, "micro_batch": 2}, "accelerate"),
 "acc-lora-w2": ({"strategy": "accelerate", "method": "lora", "world_size": 2, "micro_batch": 2}, "accelerate"),
 "acc-w2": ({"strategy": "accelerate", "world_size": 2, "micro_batch": 1, "grad_accum": 2}, "accelerate"),
 "z0-w1": ({"strategy": "deepspeed", "world_size": 1, "micro_batch": 2, "grad_accum": 2,
            "deepspeed": {"zero_stage": 0}}, "deepspeed"),
 "z1-w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
            "deepspeed": {"zero_stage": 1}}, "deepspeed"),
 "z2-w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
            "deepspeed": {"zero_stage": 2}}, "deepspeed"),
 "z3-w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
            "deepspeed": {"zero_stage": 3}}, "deepspeed"),
 "z3off-w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
               "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}}, "deepspeed"),
 "fsdp-w2": ({"strategy": "fsdp", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
              "fsdp": {"reshard_after_forward": True}}, "fsdp"),
 "fsdp-norsh-w2": ({"strategy": "fsdp", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
                    "fsdp": {"reshard_after_forward": False}}, "fsdp"),
 "fsdp-off-w2": ({"strategy": "fsdp", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
                  "fsdp": {"cpu_offload": True}}, "fsdp"),
 "z3-lora-w2": ({"strategy": "deepspeed", "method": "lora", "world_size": 2, "micro_batch": 2,
                 "deepspeed": {"zero_stage": 3}}, "deepspeed"),
 "fsdp-lora-w2": ({"strategy": "fsdp", "method": "lora", "world_size": 2, "micro_batch": 2}, "fsdp"),
 "ddp-lora-bf16-w1": ({"strategy": "ddp", "method": "lora", "precision": "bf16", "world_size": 1, "micro_batch": 2},
                      "ddp"),
 "z2-bf16-w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "precision": "bf16",
                 "deepspeed": {"zero_stage": 2}}, "deepspeed"),
 "z0-bf16-w1": ({"strategy": "deepspeed", "world_size": 1, "micro_batch": 2, "precision": "bf16",
                 "deepspeed": {"zero_stage": 0}}, "deepspeed"),
 "z1-bf16-w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "precision": "bf16",
                 "deepspeed": {"zero_stage": 1}}, "deepspeed"),
 "z3off-lora-bf16-w1": ({"strategy": "deepspeed", "method": "lora", "world_size": 1, "micro_batch": 1,
                         "precision": "bf16", "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu",
                                                            "offload_param": "cpu"}}, "deepspeed"),
 "tp-w2": ({"strategy": "tp", "world_size": 2, "micro_batch": 2}, "parallel"),
 "pp-w2": ({"strategy": "pp", "world_size": 2, "micro_batch": 4, "pp": {"schedule": "gpipe", "microbatches": 2}},
           "parallel"),
 "ddp-lora-w2": ({"strategy": "ddp", "method": "lora", "world_size": 2, "micro_batch": 2}, "ddp"),
}
want = sys.argv[1:] or list(CASES)
out = WORK / "runs"
out.mkdir(parents=True, exist_ok=True)
shape = advisor.model_shape(json.loads((root / "model" / "config.json").read_text()))
adv = {"model": {"shape": shape}}
for name in want:
    ov, stage = CASES[name]
    f = out / name / "metrics.json"
    if not f.exists():
        spec = resolve(ov, stage=stage, **base)
        t = time.time()
        try:
            run_experiment(root, out / name, spec, checkpoint=False)
        except Exception as e:
            print(name, "FAILED", e)
            continue
        print(name, "ran in", round(time.time() - t, 1), "s", flush=True)
    m = read_run_record(f).to_dict()
    rows = advisor_check.check_against_runs(adv, [m])
    held = m["memory"]["model_state_bytes_per_rank"]
    for r in rows:
        print(f"{name:18s} est {r['estimated_state_MiB']:8.2f} meas {r['measured_state_MiB']:8.2f} ratio "
              f"{r['measured/estimated']} {r['verdict']} {r['where']}")
    for h in held:
        print("    ", {k: (round(v/2**20, 3) if isinstance(v, int) else None) for k, v in h.items() if k != 'how'})

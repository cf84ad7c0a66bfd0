"""Unequal devices under DDP: each rank its own micro-batch, the gradient still the uniform one.

Uniform DDP gives every rank the same micro-batch, so the slowest device sets the pace and
the smallest one's memory sets the batch (the roadmap: "the smaller one limits"). With
`rank_micro_batch: [6, 2]` rank r reads b_r samples of each global batch of B = sum(b_r):
one seeded permutation of the data is cut into global batches of B, rank r takes its slice
(distlab.rank.loop.IndexStream), so a 1-rank run with micro_batch B reads the same samples.

The gradient. Every step's loss is the mean over the step's label tokens, counted over all
ranks before the forward (distlab.runtime.accumulation): rank r back-propagates its summed
token loss over that count, so DDP's sum of the ranks' parts is the 1-rank gradient of the same
global batch however unequal the slices are (tests/test_unequal.py, 1e-6).

`auto` sizes the batches at start: each rank times forward+backward of its model on
random tokens (seconds per sample) and reads its free memory (CUDA: free device memory; CPU:
its memory budget minus its RSS, or the machine's available RAM over the local ranks); the
global batch micro_batch x W is split in proportion to speed, each rank capped at what its
memory holds (activations per sample from distlab.tools.advisor, plus the gradient, DDP bucket and
AdamW state still to come: 16 bytes per trainable parameter).
"""
from __future__ import annotations

import os
import time

from distlab.records.spec import Spec
from distlab.configuration.config_links import split_batch  # the advisor predicts with the same split


# Timed forward+backward passes per rank, after one untimed: at least PROBE_PASSES and at least
# PROBE_SECONDS of them, so a CPU budget's throttling (10 ms periods) is inside the average.
PROBE_PASSES, PROBE_SECONDS = 3, 0.3


def rank_threads(spec: Spec, rank: int) -> int:
    """This rank's CPU threads: its rank_cpu_threads entry, else cpu_threads_per_rank."""
    per_rank = spec.rank_cpu_threads
    return per_rank[rank] if per_rank else spec.cpu_threads_per_rank


def enter_cpu_budget(spec: Spec, rank: int) -> dict | None:
    """Cap this rank's CPU time at its rank_cpu_budget entry (distlab.configuration.cpu_budget); None when unset."""
    if not spec.rank_cpu_budget:
        return None
    from distlab.configuration.cpu_budget import enter

    return dict(enter(spec.rank_cpu_budget[rank]), rank=rank)


def leave_cpu_budget(record: dict | None) -> None:
    if record is not None:
        from distlab.configuration.cpu_budget import leave

        leave(record)


def free_bytes(spec: Spec, device) -> tuple[int, str]:
    """Memory this rank may still fill, and where the figure comes from."""
    import torch

    from distlab.runtime.memory import GIB, rss_now

    budget = spec.memory_budget_gib
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if budget:
            used = torch.cuda.memory_reserved(device)
            return min(free, int(budget * GIB) - used), "memory_budget_gib minus the CUDA allocator's reserved bytes"
        return free, "torch.cuda.mem_get_info (free device memory)"
    if budget:
        return int(budget * GIB) - rss_now(), "memory_budget_gib minus this rank's RSS"
    with open("/proc/meminfo") as fh:
        available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return available // local, f"MemAvailable (/proc/meminfo) over the {local} rank(s) of this machine"


def probe(model, spec: Spec, device) -> dict:
    """This rank's seconds per sample (forward+backward of micro_batch random sequences,
    median of PROBE_REPEATS after one untimed) and its free memory. Gradients are cleared
    afterwards: training starts from the same state as without the probe."""
    import torch

    batch = spec.micro_batch
    generator = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, spec.seq_len), generator=generator).to(device)
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # untimed: first-call allocations
    passes, start = 0, time.perf_counter()
    while passes < PROBE_PASSES or time.perf_counter() - start < PROBE_SECONDS:
        step()
        passes += 1
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    free, how = free_bytes(spec, device)
    return {"seconds_per_sample": elapsed / (passes * batch), "passes": passes, "free_bytes": free,
            "free_how": how, "threads": torch.get_num_threads()}


def memory_capacity(model, spec: Spec, free: int) -> int:
    """Samples this rank's free memory holds: activations per sample (the advisor's estimate,
    distlab.runtime.activations) plus the gradient, DDP bucket and AdamW state still to be
    allocated (16 bytes/trainable param)."""
    from distlab.runtime.activations import activation_bytes
    from distlab.runtime.parameter_counts import model_shape, workload_counts

    shape = model_shape(model.config.to_dict())
    counts = workload_counts(shape, spec)
    workload = {key: spec[key] for key in ("method", "seq_len", "precision", "lora", "device",
                                           "activation_checkpointing", "activation_checkpointing_every")}
    per_sample = activation_bytes(shape, {**workload, "micro_batch": 1}, counts)  # DDP's, one sample
    to_come = 16 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(0, int((free - to_come) // per_sample))


def rank_batches(model, spec: Spec, device) -> tuple[list[int] | None, dict | None]:
    """(each rank's micro-batch, how it was chosen) for rank_micro_batch; (None, None) when unset.
    Collective for auto (every rank probes, all see every probe and compute the same split)."""
    choice = spec.rank_micro_batch
    if choice is None:
        return None, None
    if choice != "auto":
        return list(choice), {"how": "given (rank_micro_batch)", "sizes": list(choice)}
    import torch.distributed as dist

    mine = probe(model, spec, device)
    mine["capacity_samples"] = memory_capacity(model, spec, mine["free_bytes"])
    probes = [None] * dist.get_world_size()
    dist.all_gather_object(probes, mine)
    total = spec.micro_batch * len(probes)
    sizes = split_batch(total, [1 / p["seconds_per_sample"] for p in probes],
                        [p["capacity_samples"] for p in probes])
    return sizes, {"how": ("auto: the global batch micro_batch x world_size split in proportion to each rank's "
                           "measured speed (1 / seconds per sample of forward+backward on random tokens, averaged "
                           f"over at least {PROBE_PASSES} passes and {PROBE_SECONDS} s), capped by the samples its "
                           "free memory holds"),
                   "sizes": sizes, "probes": probes}


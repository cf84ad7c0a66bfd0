"""Collective bandwidth benchmark: all-reduce, all-gather, reduce-scatter over message sizes.

Its ranks start as training's do (rule collectives: run_benchmark, distlab.launchers.ranks),
under torchrun on loopback only (distlab.launchers.torchrun.torchrun_command(2,
"distlab.tools.collectives", "--out", "c.json")); a plain torchrun would listen on every interface.
gloo is measured on CPU tensors; where GPUs exist NCCL is measured on CUDA tensors in the
same process group ("cpu:gloo,cuda:nccl").

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): `size` is the whole buffer in bytes
(all-gather: the gathered output, reduce-scatter: the input), algbw = size / time, and
busbw = algbw * factor with factor 2(n-1)/n for all-reduce and (n-1)/n for all-gather and
reduce-scatter, so busbw is comparable with the link's peak whatever the rank count.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from distlab.records.collectives import OPS
from distlab.records.spec import Spec

SCHEMA_VERSION = 1
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def plan(bench: dict, specs: dict, gpu_count: int) -> dict:
    """What rule collectives runs on this machine, sized to the GPUs that exist.

    NCCL is measured where the config trains on CUDA and at least 2 GPUs exist, on at most
    gpu_count ranks. With fewer than 2 GPUs there is no device-to-device link to measure (a
    1-rank all-reduce moves no bytes): gloo is measured on CPU ranks and NCCL is recorded as
    skipped, with the reason, in collectives.json and the report.
    """
    cuda = any(spec.device == "cuda" for spec in specs.values())
    world = bench["world_size"] or max([2] + [spec.world_size for spec in specs.values()])
    nccl_skipped = None
    if cuda and gpu_count < 2:
        nccl_skipped = (f"NCCL collectives need at least 2 GPUs; this machine has {gpu_count} (a 1-rank "
                        "all-reduce moves no bytes between devices): gloo measured on CPU ranks only")
    elif cuda:
        world = min(world, gpu_count)
    device = "cuda" if cuda and nccl_skipped is None else "cpu"
    return {"world_size": world, "device": device, "gpus": world if device == "cuda" else 0,
            "nccl_skipped": nccl_skipped, "min_bytes": bench["min_bytes"],
            "max_bytes": bench["max_bytes_cuda"] if device == "cuda" else bench["max_bytes_cpu"],
            "factor": bench["factor"], "iters": bench["iters"], "warmup": bench["warmup"]}


def command_args(plan: dict, out: str, machine: str) -> list[str]:
    """The benchmark's command-line arguments for a plan (rule collectives, and under a link
    rule link_collectives)."""
    args = ["--out", out, "--device", plan["device"], "--machine", machine, "--min-bytes", str(plan["min_bytes"]),
            "--max-bytes", str(plan["max_bytes"]), "--factor", str(plan["factor"]), "--iters", str(plan["iters"]),
            "--warmup", str(plan["warmup"])]
    return args + (["--nccl-skipped", plan["nccl_skipped"]] if plan.get("nccl_skipped") else [])


def rank_spec(plan: dict) -> Spec:
    """The benchmark's ranks as the rank service starts them (distlab.launchers.ranks):
    torchrun, one thread each (the rule's `threads` is one core per rank)."""
    return Spec({"world_size": plan["world_size"], "device": plan["device"], "cpu_threads_per_rank": 1,
                 "launcher": "torchrun"})


def run_benchmark(plan: dict, out: str, machine: str, timeout: float | None = None) -> None:
    """Rule collectives: start the benchmark's ranks on this machine through the service
    training and validation use (they die with this process, and all of them on a timeout),
    holding the GPUs the plan measures from the lock folder of the results folder `out` is in
    (<results>/<machine>/collectives.json). Their output goes to this process's stdout."""
    from distlab.jobs.gpu_alloc import lock_dir_for
    from distlab.jobs.launch import assigned_gpus
    from distlab.launchers.ranks import start_ranks

    spec, where = rank_spec(plan), os.path.abspath(out)
    with assigned_gpus(spec, lock_dir=lock_dir_for(os.path.dirname(os.path.dirname(where)))) as ids:
        if ids:
            print(f"GPUs held: {ids}", flush=True)
        start_ranks(spec, "distlab.tools.collectives", command_args(plan, out, machine), where, None, timeout,
                    what="collective benchmark ranks")


def skipped_rows(reason: str) -> list[dict]:
    return [{"backend": "nccl", "device": "cuda", "op": op, "status": "skipped", "reason": reason} for op in OPS]


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min, min*factor, ... up to max (inclusive), as nccl-tests' -b/-e/-f do."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad size sweep: min {min_bytes}, max {max_bytes}, factor {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def bandwidths(op: str, size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s, nccl-tests formulas."""
    algbw = size_bytes / seconds
    return algbw, algbw * BUSBW_FACTOR[op](world)


def iterations_for(size_bytes: int, iters: int) -> int:
    """Fewer timed repetitions for huge messages keeps the sweep cheap; never under 3."""
    return max(3, min(iters, int(iters * (1 << 22) / max(size_bytes, 1 << 22))))


def single_tensor_collectives():
    """(all_gather, reduce_scatter) on single output/input tensors. torch 2.13 names them
    all_gather_single / reduce_scatter_single and deprecates the older names, which are
    all torch 2.6-2.12 have (all_gather_into_tensor / reduce_scatter_tensor, same arguments)."""
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)


def _run_op(op: str, size_bytes: int, device, world: int):
    import torch
    import torch.distributed as dist

    elements = max(world, size_bytes // 4 // world * world)  # float32; divisible by the rank count
    if op == "all_reduce":
        buffer = torch.ones(elements, device=device)
        return lambda: dist.all_reduce(buffer), elements * 4
    if op == "all_gather":
        shard = torch.ones(elements // world, device=device)
        out = torch.empty(elements, device=device)
        return lambda: single_tensor_collectives()[0](out, shard), elements * 4
    full = torch.ones(elements, device=device)
    shard = torch.empty(elements // world, device=device)
    return lambda: single_tensor_collectives()[1](shard, full), elements * 4


def _time_op(call, device, iters: int, warmup: int) -> list[float]:
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        dist.barrier()  # every rank starts together; the barrier itself is outside the timer
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def benchmark(backends: list[tuple[str, str]], sizes: list[int], iters: int, warmup: int) -> list[dict]:
    """Every (backend, device type) x op x size; each time is the slowest rank's (max over ranks)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for backend, device_type in backends:
        device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0))) if device_type == "cuda" \
            else torch.device("cpu")
        for op in OPS:
            for size in sizes:
                row = {"backend": backend, "device": device_type, "op": op, "requested_bytes": size}
                try:
                    call, actual = _run_op(op, size, device, world)
                    local = _time_op(call, device, iterations_for(size, iters), warmup)
                except (RuntimeError, NotImplementedError) as exc:  # e.g. an op the backend lacks
                    row.update(status="unsupported", reason=str(exc).splitlines()[0][:300])
                    rows.append(row)
                    continue
                per_rank = [None] * world
                dist.all_gather_object(per_rank, local)
                slowest = [max(r[i] for r in per_rank) for i in range(len(local))]
                median = statistics.median(slowest)
                algbw, busbw = bandwidths(op, actual, median, world)
                row.update(status="ok", size_bytes=actual, iters=len(slowest), time_s_median=median,
                           time_s_min=min(slowest), time_s_max=max(slowest), algbw_bytes_per_s=algbw,
                           busbw_bytes_per_s=busbw)
                rows.append(row)
                if rank == 0:
                    print(f"{backend:5s} {op:15s} {actual:>12d} B  {median * 1e6:10.1f} us  "
                          f"algbw {algbw / 1e9:7.3f} GB/s  busbw {busbw / 1e9:7.3f} GB/s", flush=True)
    return rows



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="collectives.json to write (rank 0)")
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: NCCL on GPU tensors and gloo on CPU tensors; cpu: gloo only")
    parser.add_argument("--machine", default=None, help="machine tag recorded in the output")
    parser.add_argument("--nccl-skipped", default=None, help="why NCCL is not measured here (plan())")
    args = parser.parse_args(argv)

    from distlab.launchers.process import die_with_parent

    die_with_parent(same_launch=True)  # a rank never outlives its launcher (torchrun)
    import torch
    import torch.distributed as dist

    from distlab.records.metrics import library_versions

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no GPU; refusing to measure something else")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend="cpu:gloo,cuda:nccl")
        backends = [("nccl", "cuda"), ("gloo", "cpu")]
    else:
        dist.init_process_group(backend="gloo")
        backends = [("gloo", "cpu")]
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    rows = benchmark(backends, sizes, args.iters, args.warmup)
    if args.nccl_skipped:
        rows += skipped_rows(args.nccl_skipped)
    if dist.get_rank() == 0:
        result = {
            "schema_version": SCHEMA_VERSION, "machine": args.machine, "world_size": dist.get_world_size(),
            "device": args.device, "threads_per_rank": torch.get_num_threads(),
            "results": rows, "versions": library_versions(),
            "nccl": {"status": "skipped", "reason": args.nccl_skipped} if args.nccl_skipped else
                    {"status": "measured" if args.device == "cuda" else "not asked (no CUDA experiment)"},
            "how": ("per size: warm-up calls, then timed calls each started after a barrier (CUDA synchronised); "
                    "a call's time is the slowest rank's; median over calls. float32 buffers. "
                    "algbw = size/time; busbw = algbw*2(n-1)/n (all-reduce), *(n-1)/n (all-gather, "
                    "reduce-scatter) as in nccl-tests"),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

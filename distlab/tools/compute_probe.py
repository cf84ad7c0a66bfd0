"""The compute probe: times the kernels a run's step is made of, at the model's own shapes, the
rank's thread count and dtype, so that the step-time model (distlab.tools.step_time) predicts
from measured parts rather than a datasheet peak. One probe per machine and model; the kernel
list comes from every experiment's spec (`step_time.kernels_needed`).

The kernels are timed in ROUNDS interleaved rounds (each round times every kernel, for its share
of TIME_PER_KERNEL_S), and each kernel's time is the median of all its calls: on a shared machine
(a VM's cores, other tenants) the slowdown comes and goes over seconds, and timing each kernel in
one stretch gave one kernel a quiet spell and the next a busy one (matmul rates of one probe
spread 32-91 GFLOP/s). Interleaved, every kernel samples the same spells.

Rule compute_probe runs it in a process of its own (`run_probe`, distlab.launchers.call), which on
CPU forks from the run's warm-start server as ranks do: its kernels take ~1-2 s here, torch's and
transformers' imports ~5-7 s, paid once per probe key otherwise.
"""
from __future__ import annotations

import json
import mmap
import os
import statistics
import struct
import time

ROUNDS = 5
MAX_REPEATS = 40
TIME_PER_KERNEL_S = 0.05  # all rounds together
WARMUP = 1
PROBE_NOISE_HOW = ("others' CPU = the machine's busy CPU time (/proc/stat) minus the probe process's and its forked "
                   "neighbours' CPU time, over the timed rounds; busy when others used more cores on average than "
                   "the probe left free (machine cores - timed kernel and neighbours x threads) plus the runs' "
                   "margin (distlab.runtime.noise.BUSY_MARGIN_CORES)")


def _timed_round(call, sync, budget_s: float, max_calls: int) -> list[float]:
    """One round of one kernel: at least one call, more while the round's budget lasts."""
    times, spent = [], 0.0
    while not times or (spent < budget_s and len(times) < max_calls):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return times


def toy_model(config_json: dict):
    """The model's family and depth at toy width: its config with hidden size 16, 2 heads (of
    8), intermediate 32 and a 64-token vocabulary, randomly initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_json)
    for name, value in {"hidden_size": 16, "intermediate_size": 32, "n_inner": 32, "num_attention_heads": 2,
                        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64}.items():
        if hasattr(config, name) and getattr(config, name) is not None:
            setattr(config, name, value)
    return AutoModelForCausalLM.from_config(config)


def _kernel(kind: str, dims: list[int], dtype, device, config_json: dict | None = None):
    """(forward-only call or None, full call) of one kernel."""
    import torch
    import torch.nn.functional as F

    def rand(*shape, grad=False, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt, requires_grad=grad)

    if kind == "mm":
        m, k, n = dims
        a, b = rand(m, k), rand(k, n)
        return None, lambda: a @ b
    if kind == "sdpa":
        rows, heads, seq, head_dim = dims
        q, k, v = (rand(rows, heads, seq, head_dim, grad=True) for _ in range(3))

        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both():
            forward().sum().backward()
        return forward, both
    if kind == "elementwise":
        # A decoder layer's work outside its matmuls: two RMSNorms, rotary embedding of q and k,
        # the gated MLP's activation, two residual adds (Llama-like families).
        tokens, hidden, inter = dims
        x, q, k = rand(tokens, hidden, grad=True), rand(tokens, hidden, grad=True), rand(tokens, hidden, grad=True)
        gate, up = rand(tokens, inter, grad=True), rand(tokens, inter, grad=True)
        cos, sin = rand(tokens, hidden), rand(tokens, hidden)
        weight = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)

        def norm(h):
            h32 = h.float()
            return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * weight

        def rotate(t):
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

        def forward():
            a = norm(x)
            r = rotate(q) + rotate(k)
            m = F.silu(gate) * up
            return a + norm(x + a) + r, m

        def both():
            a, m = forward()
            (a.sum() + m.sum()).backward()
        return forward, both
    if kind == "cross_entropy":
        tokens, vocab = dims
        logits = rand(tokens, vocab, grad=True)
        labels = torch.randint(0, vocab, (tokens,), device=device)

        def both():  # transformers upcasts the logits to fp32 for the loss
            F.cross_entropy(logits.float(), labels).backward()
        return None, both
    if kind == "framework":
        # The model's whole op graph at toy width (hidden 16, 2 heads, vocab 64), forward and
        # backward at the run's rows x sequence: what dispatch, autograd and the family's
        # elementwise ops cost per micro-step when the matmuls cost nothing.
        rows, seq = dims
        model = toy_model(config_json).to(device=device, dtype=dtype)
        ids = torch.randint(0, model.config.vocab_size, (rows, seq), device=device)

        def both():
            model(input_ids=ids, labels=ids).loss.backward()
        return None, both
    if kind.startswith("wrapped-"):
        # The same toy-width model and step as `framework`, wrapped as the run wraps it
        # (sharding_wrapper): on one rank, so what the wrapper adds is its hooks and bookkeeping.
        return None, _wrapped_step(kind.removeprefix("wrapped-"), dims, dtype, device, config_json)
    if kind == "dequant_nf4":  # QLoRA's frozen weight back to the compute dtype (bitsandbytes, NF4, nested)
        import bitsandbytes.functional as bnb

        out_features, in_features = dims
        packed, state = bnb.quantize_4bit(rand(out_features, in_features), quant_type="nf4", compress_statistics=True,
                                          quant_storage=torch.uint8)
        return None, lambda: bnb.dequantize_4bit(packed, state).to(dtype)
    if kind == "adamw":
        (n,) = dims
        param = torch.nn.Parameter(torch.randn(n, device=device))
        param.grad = torch.randn(n, device=device)
        optimizer = torch.optim.AdamW([param], lr=1e-4)
        return None, optimizer.step
    if kind == "copy":
        (nbytes,) = dims
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return None, lambda: dst.copy_(src)
    raise ValueError(f"unknown probe kernel {kind!r}")


WRAPPED_GA = 2**20  # ZeRO-3's engine never reaches an optimizer step in the probe's calls


def _one_rank_group(device: str) -> None:
    """A process group of this process alone (an in-process store: nothing listens), for a
    wrapper that needs one; a probe process has none of its own."""
    import torch.distributed as dist

    if not dist.is_initialized():
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def _wrapped_step(wrapper: str, dims: list[int], dtype, device, config_json: dict):
    """One micro-step (forward and backward) of the toy-width model wrapped as a run of
    `wrapper` wraps it, on one rank: zero3 / zero3lean: DeepSpeed ZeRO-3 with its zero3_profile
    sized from the toy model itself (zero3_limits: persistence threshold 10 x hidden keeps the
    norms whole and gathers every linear, as at full width; lean gathers everything) and the
    run's gradient bucket rule; fsdp / fsdpkeep: FSDP2 fully_shard per decoder layer, then the
    root, resharding after forward or not. The returned call's `neighbour` is the plain toy
    step: the probe's forked neighbours must not share the wrapper's process group."""
    import torch

    from distlab.runtime.model import decoder_layers

    rows, seq = dims
    _one_rank_group(device)
    model = toy_model(config_json).to(device=device, dtype=torch.float32)
    plain = toy_model(config_json).to(device=device, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), device=device)
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if wrapper in ("zero3", "zero3lean"):
        import deepspeed

        from distlab.records.spec import Spec
        from distlab.strategies.deepspeed import forget_deepspeed_groups, skip_inference_shm_op
        from distlab.strategies.deepspeed_config import deepspeed_config, gradient_bucket_size

        spec = Spec({"strategy": "deepspeed", "device": device, "precision": precision, "micro_batch": rows,
                     "grad_accum": WRAPPED_GA, "lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0,
                     "deepspeed": {"zero_stage": 3, "offload_optimizer": "none", "offload_param": "none",
                                   "optimizer_impl": "torch",
                                   "zero3_profile": "lean" if wrapper == "zero3lean" else "auto"}})
        layer = sum(p.numel() for p in decoder_layers(model)[0].parameters())
        sizes = [p.numel() for p in model.parameters()]
        config = deepspeed_config(spec, 1, layer, gradient_bucket_size(layer, max(sizes), sum(sizes)),
                                  model.config.hidden_size)
        if device == "cpu":
            skip_inference_shm_op()
        forget_deepspeed_groups()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)

        def both():
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()  # a micro-step: no optimizer step before WRAPPED_GA of them
    elif wrapper in ("fsdp", "fsdpkeep"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": init_device_mesh(device, (1,)), "reshard_after_forward": wrapper == "fsdp"}
        if precision != "fp32":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)

        def both():
            model(input_ids=ids, labels=ids).loss.backward()
    else:
        raise ValueError(f"unknown sharding wrapper {wrapper!r}")

    def neighbour():
        plain(input_ids=ids, labels=ids).loss.backward()
    both.neighbour = neighbour
    return both


class _Neighbours:
    """On CPU, `count` forked copies of this process that run, without end, the kernel the probe
    is timing: a rank's kernels share the machine's cores (SMT siblings, caches, memory bandwidth)
    with the other ranks, which run the same step, and with the jobs Snakemake runs beside it.
    Forked once; the kernel they run is switched through a shared index."""

    def __init__(self, calls: list, threads: list[int], count: int):
        self.shared = mmap.mmap(-1, 8)  # anonymous: MAP_SHARED, seen by the forked copies
        self.pids = []
        self.select(0)
        for _ in range(count):
            pid = os.fork()
            if pid == 0:  # a neighbour: whichever kernel the index names, until it is killed
                try:
                    import torch

                    running = None
                    while True:
                        index = self.current()
                        if index < 0:  # paused: the timed kernel has the machine to itself
                            time.sleep(0.0005)
                            continue
                        if threads[index] != running:
                            running = threads[index]
                            torch.set_num_threads(running)
                        calls[index]()
                finally:
                    os._exit(0)
            self.pids.append(pid)

    def select(self, index: int) -> None:
        self.shared[:8] = struct.pack("q", index)

    def pause(self) -> None:
        self.select(-1)

    def current(self) -> int:
        return struct.unpack("q", self.shared[:8])[0]

    def stop(self) -> float:
        """Kill the copies; the CPU seconds they used (user + system, every thread)."""
        import signal

        used = 0.0
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)
            _, _, usage = os.wait4(pid, 0)
            used += usage.ru_utime + usage.ru_stime
        self.shared.close()
        return used


def probe(kernels: list[dict], device: str = "cpu", config_json: dict | None = None) -> dict:
    """{kernels: {"<key>|<dtype>|<threads>": {s, forward_s, alone_s, forward_alone_s, repeats,
    round_s}}, noise, how} for the distinct kernels listed. noise: what other processes used while
    the kernels were timed, and whether that makes the probe busy (distlab.runtime.noise, the
    runs' own rule): a busy probe's kernels are slow by an amount it cannot know, and the report
    does not score the runs predicted from it."""
    import torch

    from distlab.runtime.noise import NoiseProbe, summarize_noise

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cores = len(os.sched_getaffinity(0))  # the cores this job may use: all of them (rule compute_probe)
    before = torch.get_num_threads()
    distinct = {}
    for k in kernels:
        distinct.setdefault(f"{k['key']}|{k['dtype']}|{k['threads']}", k)
    names = list(distinct)
    built = [_kernel(distinct[n]["kind"], distinct[n]["dims"], getattr(torch, distinct[n]["dtype"]), device,
                     config_json) for n in names]
    threads = [max(1, distinct[n]["threads"]) for n in names]
    # One rank's threads per neighbour, on every core the timed kernel leaves (a probe key has one thread count).
    others = max(0, cores // max(threads) - 1) if device == "cpu" else 0
    # Each kernel is timed beside its neighbours (the step as a full machine runs it) and, where
    # there are any, alone (a 1-rank run the workflow left a core to): half of its budget each.
    sides = ("beside", "alone") if others else ("beside",)
    budget, calls = TIME_PER_KERNEL_S / ROUNDS / len(sides), max(1, MAX_REPEATS // ROUNDS // len(sides))
    times = {(n, side, part): [] for n in names for side in sides for part in ("both", "forward")}
    round_medians = {n: [] for n in names}
    window = NoiseProbe()  # what other processes used while the kernels were timed
    window.start()
    neighbours = _Neighbours([getattr(both, "neighbour", both) for _, both in built], threads, others)
    try:
        for round_index in range(ROUNDS):
            for i, name in enumerate(names):
                forward, both = built[i]
                if device == "cpu":
                    torch.set_num_threads(threads[i])
                for side in sides:
                    if side == "beside":
                        neighbours.select(i)
                    else:
                        neighbours.pause()
                    if round_index == 0 and side == "beside":
                        for _ in range(WARMUP):
                            both()
                        sync()
                    got = _timed_round(both, sync, budget, calls)
                    times[name, side, "both"] += got
                    if side == "beside":
                        round_medians[name].append(statistics.median(got))
                    if forward is not None:
                        with torch.no_grad():
                            times[name, side, "forward"] += _timed_round(forward, sync, budget, calls)
    finally:
        neighbours_cpu = neighbours.stop()
        torch.set_num_threads(before)
    # The probe holds the machine (rule compute_probe: every core), so, as for a run that fills
    # it, others using more than the margin of a core made its kernels wait for one.
    noise = summarize_noise([window.stop(), {"own_cpu_s": neighbours_cpu}], min(cores, (others + 1) * max(threads)),
                            cores, PROBE_NOISE_HOW)
    rows = {}
    for name in names:
        rows[name] = {"s": statistics.median(times[name, "beside", "both"]),
                      "repeats": len(times[name, "beside", "both"]), "neighbours": others,
                      "round_s": round_medians[name]}
        if times[name, "beside", "forward"]:
            rows[name]["forward_s"] = statistics.median(times[name, "beside", "forward"])
        if "alone" in sides:
            rows[name]["alone_s"] = statistics.median(times[name, "alone", "both"])
            if times[name, "alone", "forward"]:
                rows[name]["forward_alone_s"] = statistics.median(times[name, "alone", "forward"])
    return {"kernels": rows, "device": device, "rounds": ROUNDS, "noise": noise,
            "how": (f"each kernel at its shape, dtype and thread count: {ROUNDS} interleaved rounds over every "
                    f"kernel, each kernel called for {budget} s a round (at least once) after {WARMUP} warm-up "
                    "call, the median of all its calls (round_s: each round's median); random inputs; on CPU "
                    "while forked copies run the same kernel on every other core (neighbours: the other ranks of "
                    "the step), and as long again with those copies paused (alone_s, forward_alone_s: the machine "
                    "to itself); forward_s: the forward alone, without autograd")}


def probe_key_file(model_config: str, key: str, model: str, out: str) -> None:
    """Time the kernels of probe key `key` (distlab.tools.step_time.probe_key) at the shapes of the
    model whose config.json is `model_config`, and write them to `out`."""
    from distlab.launchers.warm_start import start_record
    from distlab.runtime.parameter_counts import model_shape, parameter_counts
    from distlab.tools.step_time import kernels_needed, parse_probe_key

    started = time.perf_counter()
    with open(model_config) as fh:
        config_json = json.load(fh)
    shape = model_shape(config_json)
    found = probe(kernels_needed(key, shape, parameter_counts(shape)), parse_probe_key(key)["device"], config_json)
    with open(out, "w") as fh:
        json.dump({"model": model, "key": key, **found, "start": start_record(),
                   "probe_seconds": time.perf_counter() - started}, fh, indent=1)
    print(f"{len(found['kernels'])} kernel(s) timed for {model} at {key}", flush=True)


def run_probe(model_config: str, key: str, model: str, out: str) -> None:
    """Rule compute_probe: probe_key_file in a process of its own (distlab.launchers.call): a CPU
    key's may start warm; a CUDA key's sees the job's GPUs and starts fresh, as a GPU rank does."""
    from distlab.launchers.call import call_in_own_process
    from distlab.tools.step_time import parse_probe_key

    call_in_own_process("distlab.tools.compute_probe:probe_key_file", out, device=parse_probe_key(key)["device"],
                        model_config=model_config, key=key, model=model, out=out)

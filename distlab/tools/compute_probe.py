"""The compute probe: times the kernels a run's step is made of, at the model's own shapes, the
rank's thread count and dtype, so that the step-time model (distlab.tools.step_time) predicts
from measured parts rather than a datasheet peak. One probe per machine and model; the kernel
list comes from every experiment's spec (`step_time.kernels_needed`).

Each kernel is timed after warm-up calls, as the median of repeated calls (at least
MIN_REPEATS, until TIME_PER_KERNEL_S is spent), on fresh random inputs of its shape.

Rule compute_probe runs it in a process of its own (`run_probe`, distlab.launchers.call), which on
CPU forks from the run's warm-start server as ranks do: its kernels take ~1-2 s here, torch's and
transformers' imports ~5-7 s, paid once per probe key otherwise.
"""
from __future__ import annotations

import json
import os
import statistics
import time

MIN_REPEATS = 3
MAX_REPEATS = 40
TIME_PER_KERNEL_S = 0.05
WARMUP = 1


def _timed(call, sync) -> tuple[float, int]:
    for _ in range(WARMUP):
        call()
    sync()
    times, spent = [], 0.0
    while len(times) < MIN_REPEATS or (spent < TIME_PER_KERNEL_S and len(times) < MAX_REPEATS):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times), len(times)


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


def _neighbours(call, count: int) -> list[int]:
    """`count` forked copies of this process running `call` without end: on CPU a rank's kernels
    share the machine's cores (SMT siblings, caches, memory bandwidth) with the other ranks and
    the jobs Snakemake runs beside it, so each kernel is timed with every other core busy."""
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:  # the neighbour: the same kernel until it is killed
            try:
                while True:
                    call()
            finally:
                os._exit(0)
        pids.append(pid)
    return pids


def _stop(pids: list[int]) -> None:
    import signal

    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def probe(kernels: list[dict], device: str = "cpu", config_json: dict | None = None) -> dict:
    """{kernels: {"<key>|<dtype>|<threads>": {s, forward_s, repeats}}, how} for the distinct
    kernels listed."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cores = len(os.sched_getaffinity(0))  # the cores this job may use: all of them (rule compute_probe)
    before = torch.get_num_threads()
    rows = {}
    try:
        for k in kernels:
            name = f"{k['key']}|{k['dtype']}|{k['threads']}"
            if name in rows:
                continue
            if device == "cpu":
                torch.set_num_threads(k["threads"])
            forward, both = _kernel(k["kind"], k["dims"], getattr(torch, k["dtype"]), device, config_json)
            others = max(0, cores // max(1, k["threads"]) - 1) if device == "cpu" else 0
            neighbours = _neighbours(both, others)
            try:
                seconds, repeats = _timed(both, sync)
                row = {"s": seconds, "repeats": repeats, "neighbours": others}
                if forward is not None:
                    with torch.no_grad():
                        row["forward_s"] = _timed(forward, sync)[0]
            finally:
                _stop(neighbours)
            rows[name] = row
    finally:
        torch.set_num_threads(before)
    return {"kernels": rows, "device": device,
            "how": (f"each kernel at its shape, dtype and thread count: median of >= {MIN_REPEATS} calls (up to "
                    f"{TIME_PER_KERNEL_S} s each) after {WARMUP} warm-up calls, random inputs; on CPU while "
                    "forked copies run the same kernel on every other core (neighbours: the machine as a "
                    "pipeline fills it); forward_s: the forward alone, without autograd")}


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

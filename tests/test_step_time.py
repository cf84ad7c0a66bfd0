"""The step-time model's promises, each term against a hand computation on a small case
(distlab.tools.step_time): what a run's prediction adds up, and how the report scores it."""
from __future__ import annotations

import math

import pytest

from distlab.records import predictions
from distlab.tools import step_time as S
from distlab.records.spec import Spec

# A two-layer model with two linears per layer (one column-, one row-parallel) and a head.
LAYER = [((16, 8), True), ((8, 16), True), ((8,), True)]  # (shape, trains): attn, mlp, norm
SHAPES = LAYER * 2 + [((32, 8), True), ((32, 8), True), ((8,), True)]  # + embedding, head, final norm
COUNTS = {"layers": 2, "trainable": 1048, "total": 1048, "per_layer": 264, "hidden_size": 8, "_shapes": SHAPES,
          "_linears": [("attn", 8, 16, 0), ("mlp", 16, 8, 1), ("lm_head", 8, 32, None)]}
GRADS = 1048 * 4  # fp32 gradient bytes
SHAPE = {"num_attention_heads": 2, "head_dim": 4, "hidden_size": 8, "intermediate_size": 16, "vocab_size": 32}


def spec(**over) -> Spec:
    base = {"strategy": "ddp", "world_size": 1, "micro_batch": 2, "grad_accum": 1, "seq_len": 4, "method": "full",
            "precision": "fp32", "device": "cpu", "cpu_threads_per_rank": 1, "max_grad_norm": 1.0,
            "pp": {"schedule": "gpipe", "microbatches": 2}, "deepspeed": {"zero_stage": 0, "offload_optimizer": "none",
                                                                         "offload_param": "none"},
            "fsdp": {"reshard_after_forward": True, "cpu_offload": False}}
    base.update(over)
    return Spec(base)


def probe_for(s: dict, seconds_of) -> dict:
    """A probe that gives each kernel the time `seconds_of(kernel)` (forward: a third of it)."""
    rows = {}
    for k in S.kernels_needed(S.probe_key(s), SHAPE, COUNTS):
        t = seconds_of(k)
        rows[f"{k['key']}|{k['dtype']}|{k['threads']}"] = {"s": t, "forward_s": t / 3}
    return {"kernels": rows}


def flops_time(k) -> float:
    """1 s per 1000 multiply-adds for matmuls; fixed times for the rest."""
    if k["kind"] == "mm":
        return math.prod(k["dims"]) / 1000
    return {"sdpa": 0.01, "elementwise": 0.02, "cross_entropy": 0.05, "framework": 0.04, "adamw": 0.1,
            "copy": 0.03, "wrapped-zero3": 0.07, "wrapped-zero3lean": 0.09, "wrapped-fsdp": 0.05,
            "wrapped-fsdpkeep": 0.045}[k["kind"]]


def test_compute_is_each_layers_matmuls_attention_and_elementwise_plus_the_head_per_micro_step():
    s = spec(grad_accum=3)
    got = S.compute_term(s, SHAPE, COUNTS, probe_for(s, flops_time))
    tokens = 2 * 4
    # per linear: forward, input gradient, weight gradient, each tokens x in x out multiply-adds
    layer = sum(3 * tokens * i * o / 1000 for i, o in [(8, 16), (16, 8)]) + 0.01 + 0.02
    head = 3 * tokens * 8 * 32 / 1000 + 0.05
    framework = 0.04  # the toy-width model's forward and backward: the op graph's own cost
    assert got["seconds"] == pytest.approx(3 * (2 * layer + head + framework))


def test_a_frozen_base_gets_no_weight_gradient_matmuls():
    s = spec(method="lora")
    got = S.compute_term(s, SHAPE, COUNTS, probe_for(s, flops_time))
    tokens = 8
    layer = sum(2 * tokens * i * o / 1000 for i, o in [(8, 16), (16, 8)]) + 0.01 + 0.02
    head = 2 * tokens * 8 * 32 / 1000 + 0.05
    assert got["seconds"] == pytest.approx(2 * layer + head + 0.04)


def test_activation_checkpointing_adds_one_forward_per_checkpointed_layer():
    s = spec()
    plain = S.compute_term(s, SHAPE, COUNTS, probe_for(s, flops_time))
    again = S.compute_term(s, SHAPE, COUNTS, probe_for(s, flops_time), ac_layers=2)
    forward = sum(8 * i * o / 1000 for i, o in [(8, 16), (16, 8)]) + 0.01 / 3 + 0.02 / 3
    assert again["seconds"] - plain["seconds"] == pytest.approx(2 * forward)


def test_a_run_leaving_cores_free_is_timed_between_its_kernels_alone_and_beside_by_what_others_used():
    s = spec()  # one rank of one thread
    beside = probe_for(s, lambda k: 2 * flops_time(k))
    for row in beside["kernels"].values():  # alone: half of beside
        row["alone_s"], row["forward_alone_s"] = row["s"] / 2, row["forward_s"] / 2
    alone = S.compute_term(s, SHAPE, COUNTS, probe_for(s, flops_time))["seconds"]
    full = 2 * alone
    # 2 cores: the run leaves one free; others used none, half of it, all of it (or more) as it started
    assert S.neighbour_share(s, 2, 0.0) == 0.0 and S.neighbour_share(s, 2, 0.5) == 0.5
    assert S.neighbour_share(s, 2, 1.7) == 1.0 and S.neighbour_share(s, 2, None) == 1.0
    for others, expect in ((0.0, alone), (0.5, 1.5 * alone), (1.7, full)):
        got = S.predict(s, SHAPE, COUNTS, beside, None, 2, others_cores=others)["terms"]["compute"]["seconds"]
        assert got == pytest.approx(expect)
    # Two ranks on two cores fill the machine: each rank's neighbour is the other, whatever else ran.
    assert S.neighbour_share(spec(world_size=2), 2, 0.0) == 1.0
    # A probe without alone times (another core never existed): beside times as they are.
    assert S.compute_term(s, SHAPE, COUNTS, probe_for(s, flops_time), neighbours=0.0)["seconds"] == alone


def test_experiments_of_the_same_shapes_share_one_probe_and_others_get_their_own():
    assert S.probe_key(spec(lr=1e-3, strategy="deepspeed", world_size=2, deepspeed={"zero_stage": 2})) == \
        S.probe_key(spec()) == "cpu-float32-t1-r2x4-tp1"
    assert S.probe_key(spec(method="qlora")).endswith("-nf4")
    # 2 pipeline micro-batches
    assert S.probe_key(spec(strategy="pp", world_size=2, micro_batch=4)) == "cpu-float32-t1-r2x4-tp1"
    assert S.parse_probe_key("cuda-bfloat16-t0-r8x2048-tp2") == {"device": "cuda", "dtype": "bfloat16", "threads": 0,
                                                                "rows": 8, "seq": 2048, "tp": 2, "nf4": False,
                                                                "wrapper": None}


def test_tensor_parallel_splits_each_linear_on_its_planned_dimension():
    s = spec(strategy="tp", world_size=2)
    keys = {k["key"] for k in S.kernels_needed(S.probe_key(s), SHAPE, COUNTS)}
    assert "mm:8x8x8" in keys  # attn: 8 -> 16 column-split to 8 -> 8; mlp: 16 -> 8 row-split to 8 -> 8
    assert "mm:8x8x32" in keys  # the head is not split
    assert not any(key.startswith("mm:8x8x16") or key.startswith("mm:8x16x8") for key in keys)


def collectives_file(latency=1e-3, busbw=1e6, world=2) -> dict:
    """A collectives.json whose calls take latency + bytes on the wire / busbw."""
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
        for size in (1024, 4096, 16384, 65536, 262144):
            rows.append({"op": op, "status": "ok", "size_bytes": size,
                         "time_s_median": latency + size * factor / busbw})
    return {"world_size": world, "results": rows}


def test_ddp_all_reduces_its_gradients_once_per_step_in_buckets():
    calls = S.collectives_per_step(spec(world_size=2, grad_accum=4), SHAPE, COUNTS)
    assert [(c["op"], c["bytes"], c["calls"]) for c in calls] == [("all_reduce", GRADS, 1)]
    big = dict(COUNTS, trainable=10 * 2**20)  # 40 MiB of fp32 gradients: 1 MiB first, then 25 MiB buckets
    sizes = [c["bytes"] for c in S.collectives_per_step(spec(world_size=2), SHAPE, big)]
    assert sizes == [2**20, 25 * 2**20, 40 * 2**20 - 26 * 2**20]


def test_each_zero_stage_and_fsdp_send_what_they_shard():
    by = {}
    for name, over in {"zero1": {"deepspeed": {"zero_stage": 1}}, "zero2": {"deepspeed": {"zero_stage": 2}},
                       "zero3": {"deepspeed": {"zero_stage": 3}}}.items():
        s = spec(strategy="deepspeed", world_size=2, grad_accum=2, **over)
        by[name] = sum(c["bytes"] * c["calls"] for c in S.collectives_per_step(s, SHAPE, COUNTS))
    fsdp = sum(c["bytes"] * c["calls"]
               for c in S.collectives_per_step(spec(strategy="fsdp", world_size=2, grad_accum=2), SHAPE, COUNTS))
    grads = GRADS
    assert by["zero1"] == 2 * grads  # one all-reduce, one all-gather per step
    assert by["zero2"] == 3 * grads  # its all-reduce every micro-batch
    # The auto profile keeps parameters of up to 10 x hidden elements whole (the norms): the rest,
    # 4 x 128 + 2 x 256 elements, gathered once per micro-batch (live until backward); gradients
    # reduce-scattered every micro-batch.
    assert by["zero3"] == pytest.approx(2 * 1024 * 4 + 2 * grads)
    lean = spec(strategy="deepspeed", world_size=2, grad_accum=2, deepspeed={"zero_stage": 3, "zero3_profile": "lean"})
    gathers = [c for c in S.collectives_per_step(lean, SHAPE, COUNTS) if c["op"] == "all_gather"]
    # Every tensor in forward; backward gathers again all but the last ones forward used, as long as
    # they fit the one-layer reuse distance (264 elements: the head, 256, and the final norm, 8).
    assert sum(c["calls"] for c in gathers) == 2 * (len(SHAPES) + len(SHAPES) - 2)
    assert fsdp == pytest.approx(2 * 2 * grads + grads)  # accumulation skips the sync: one reduce-scatter a step


def test_communication_times_each_call_at_its_size_and_hides_nothing_when_every_core_computes():
    s = spec(world_size=2)
    coll = collectives_file()
    got = S.communication_term(s, SHAPE, COUNTS, coll, {"parts": {"layers": 10.0}}, free_cores=0)
    # GRADS bytes all-reduced over 2 ranks: 1 ms + GRADS * 2(n-1)/n / 1e6 (interpolated on a log scale)
    expect = S.collective_seconds(coll, "all_reduce", GRADS, 2)
    assert expect == pytest.approx(1e-3 + GRADS / 1e6, rel=0.05)
    assert got["seconds"] == pytest.approx(expect)
    hidden = S.communication_term(s, SHAPE, COUNTS, coll, {"parts": {"layers": 10.0}}, free_cores=1)
    assert hidden["seconds"] == pytest.approx(expect)  # one bucket: the last bucket is always exposed


def test_a_collective_past_the_largest_measured_size_scales_with_bytes_and_world():
    coll = collectives_file(latency=0.0)
    assert S.collective_seconds(coll, "all_gather", 2 * 262144, 2) == pytest.approx(2 * 262144 * 0.5 / 1e6)
    # 4 ranks move (n-1)/n = 3/4 of the bytes instead of 1/2
    assert S.collective_seconds(coll, "all_gather", 262144, 4) == pytest.approx(262144 * 0.75 / 1e6)


def test_on_cpu_ranks_a_reduce_scatter_sends_what_an_all_reduce_does_and_on_gpus_half_of_it():
    # gloo reduce-scatters by all-reducing the whole input: 2(n-1)/n of it leaves each rank.
    calls = [{"op": "reduce_scatter", "bytes": 1000, "calls": 3}, {"op": "all_gather", "bytes": 1000, "calls": 1}]
    assert S.wire_bytes_per_rank(calls, 4, "cpu") == pytest.approx(3 * 1000 * 2 * 3 / 4 + 1000 * 3 / 4)
    assert S.wire_bytes_per_rank(calls, 4, "cuda") == pytest.approx(3 * 1000 * 3 / 4 + 1000 * 3 / 4)
    # From 2 measured ranks to 4: x (2*3/4) / (2*1/2) on gloo, as its all-reduce scales.
    coll = collectives_file(latency=0.0)
    measured = S.collective_seconds(coll, "reduce_scatter", 262144, 2, "cpu")
    assert S.collective_seconds(coll, "reduce_scatter", 262144, 4, "cpu") == pytest.approx(measured * 1.5)


def test_each_rank_device_reads_its_own_backends_rows_of_the_collectives_file():
    gloo, nccl = collectives_file(latency=1e-3), collectives_file(latency=1e-6, busbw=1e9)
    both = {"world_size": 2, "results": [dict(r, backend="gloo") for r in gloo["results"]]
            + [dict(r, backend="nccl") for r in nccl["results"]]}
    assert S.collective_seconds(both, "all_reduce", 4096, 2, "cpu") == pytest.approx(
        S.collective_seconds(gloo, "all_reduce", 4096, 2))
    assert S.collective_seconds(both, "all_reduce", 4096, 2, "cuda") == pytest.approx(
        S.collective_seconds(nccl, "all_reduce", 4096, 2))


def test_optimizer_is_adamw_plus_the_norm_read_plus_offload_copies():
    s = spec(strategy="deepspeed", world_size=2, grad_accum=2,
             deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})
    got = S.optimizer_term(s, COUNTS, probe_for(s, flops_time))
    # The probe's rates (AdamW 0.1 s per RATE_PARAMS parameters, 0.03 s per RATE_BYTES copied) at
    # the 524 parameters each of 2 ranks steps: AdamW + the gradient-norm read + (2 + 2 x 2
    # micro-batches) partition copies.
    adamw, copy = 0.1 * 524 / S.RATE_PARAMS, 0.03 * 524 * 4 / S.RATE_BYTES
    assert got["seconds"] == pytest.approx(adamw + copy + 6 * copy)


def test_the_pipeline_bubble_is_stages_minus_one_micro_batch_slots():
    s = spec(strategy="pp", world_size=2, micro_batch=4, pp={"schedule": "gpipe", "microbatches": 2})
    compute = {"seconds": 0.8}
    assert S.bubble_term(s, compute)["seconds"] == pytest.approx(0.4)  # 2 slots of 0.4 s, 1 idle


def test_a_busy_run_is_shown_but_not_scored_and_a_quiet_one_is_scored_within_the_tolerance():
    prediction = {"status": "predicted", "step_time_s": 1.2,
                  "terms": {"compute": {"seconds": 1.0}, "communication": {"seconds": 0.2},
                            "optimizer": {"seconds": 0.0}, "bubble": {"seconds": 0.0}}}
    assert predictions.score(prediction, 1.0, busy=True)["verdict"] == "not scored"
    assert predictions.score(prediction, 1.0, busy=False)["verdict"] == "right"
    assert predictions.score(prediction, 0.9, busy=False)["verdict"] == "off"
    assert predictions.score({"status": "not predicted", "why": "x"}, 1.0, busy=False)["verdict"] == "not predicted"


def test_the_report_names_the_term_furthest_from_what_the_run_measured():
    prediction = {"status": "predicted", "step_time_s": 1.0,
                  "terms": {"compute": {"seconds": 0.5}, "communication": {"seconds": 0.5, "total_s": 0.5},
                            "optimizer": {"seconds": 0.0}, "bubble": {"seconds": 0.0}}}
    run = {"status": "ok", "experiment": "x", "prediction": prediction, "spec": Spec({}),
           "timing": {"step_time_s": {"median": 1.5}, "comm_inflight_s_per_step": {"median": 1.0}},
           "noise": {"busy": False}}
    (row,) = predictions.check_step_times([run])
    assert row["verdict"] == "off" and row["furthest off"].startswith("communication")
    assert row["sharding s"] is None  # every row has every term's column, in one order
    sharded = {**prediction, "terms": {**prediction["terms"], "sharding": {"seconds": 0.25}}}
    timing = {"step_time_s": {"median": 3.0}, "comm_inflight_s_per_step": {"median": 0.5}}
    (row,) = predictions.check_step_times([{**run, "prediction": sharded, "timing": timing}])
    assert row["furthest off"].startswith("compute + sharding + optimizer + bubble") and row["sharding s"] == 0.25
    status, evidence = predictions.step_time_verdict([row, {**row, "verdict": "right"}] * 2)
    assert status == "failed" and "2 of 4" in evidence


def test_a_run_predicted_from_a_probe_timed_on_a_busy_machine_is_shown_but_not_scored(tmp_path):
    """The probe's own noise record (distlab.tools.compute_probe) travels into the prediction's
    inputs; a busy probe's run is not scored though the run itself was quiet."""
    import json

    from distlab.runtime.parameter_counts import model_shape, parameter_counts
    from distlab.testing import TINY_MODEL

    config = {"model_type": "llama", "vocab_size": 512, "rms_norm_eps": 1e-6,
              **{k: v for k, v in TINY_MODEL.items() if k != "seed"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hardware.json").write_text(json.dumps({"cpu": {"usable_cores": 2}}))
    s = spec(activation_checkpointing="none")
    shape = model_shape(config)
    rows = {f"{k['key']}|{k['dtype']}|{k['threads']}": {"s": 0.01, "forward_s": 0.004}
            for k in S.kernels_needed(S.probe_key(s), shape, parameter_counts(shape))}
    verdicts = {}
    for busy in (True, False):
        probe = tmp_path / f"probe-{busy}.json"
        probe.write_text(json.dumps({"kernels": rows, "noise": {"busy": busy, "others_cores": 0.9 if busy else 0.0}}))
        prediction = S.predict_from_files(s, str(tmp_path / "config.json"), str(probe), None,
                                          str(tmp_path / "hardware.json"))
        assert prediction["inputs"]["probe_busy"] is busy
        run = {"status": "ok", "experiment": f"busy-probe-{busy}", "prediction": prediction, "spec": s,
               "timing": {"step_time_s": {"median": prediction["step_time_s"]}}, "noise": {"busy": False}}
        (row,) = predictions.check_step_times([run])
        verdicts[busy] = (row["verdict"], row["why"])
    assert verdicts[True] == ("not scored", "probe timed on a busy machine")
    assert verdicts[False] == ("right", None)
    status, evidence = predictions.step_time_verdict([{"verdict": "not scored"}, {"verdict": "right"}])
    assert status == "passed" and "1 of 1" in evidence  # the busy probe's run is not counted in the goal


def test_a_probe_of_an_older_distlab_without_a_noise_record_is_not_held_against_its_runs():
    prediction = {"status": "predicted", "step_time_s": 1.0, "inputs": {"probe": "x.json"},
                  "terms": {"compute": {"seconds": 1.0}}}
    assert predictions.score(prediction, 1.0, busy=False)["verdict"] == "right"
    assert predictions.score({**prediction, "inputs": {"probe_busy": True}}, 1.0, busy=False)["why"] == \
        "probe timed on a busy machine"


ZERO3 = {"zero_stage": 3, "offload_optimizer": "none", "offload_param": "none"}


def test_only_zero3_and_fsdp_runs_get_a_probe_of_their_own_with_their_wrapped_toy_step():
    wrapped = {}
    for name, s in {"ddp": spec(world_size=2), "zero2": spec(strategy="deepspeed", world_size=2),
                    "tp": spec(strategy="tp", world_size=2), "pp": spec(strategy="pp", world_size=2, micro_batch=4),
                    "zero3": spec(strategy="deepspeed", world_size=2, deepspeed=ZERO3),
                    "zero3lean": spec(strategy="deepspeed", world_size=2, deepspeed={**ZERO3, "zero3_profile": "lean"}),
                    "fsdp": spec(strategy="fsdp", world_size=2),
                    "fsdpkeep": spec(strategy="fsdp", world_size=2,
                                     fsdp={"reshard_after_forward": False, "cpu_offload": False})}.items():
        key = S.probe_key(s)
        kernels = S.kernels_needed(key, SHAPE, COUNTS)
        wrapped[name] = (key, [k["key"] for k in kernels if k["kind"].startswith("wrapped")])
    for name in ("ddp", "zero2", "tp", "pp"):  # their probes and kernels as before
        assert wrapped[name][1] == [] and S.parse_probe_key(wrapped[name][0])["wrapper"] is None
    assert wrapped["ddp"][0] == wrapped["zero2"][0] == wrapped["pp"][0] == "cpu-float32-t1-r2x4-tp1"
    for name in ("zero3", "zero3lean", "fsdp", "fsdpkeep"):
        assert wrapped[name] == (f"cpu-float32-t1-r2x4-tp1-{name}", [f"wrapped-{name}:2x4"])
        assert S.parse_probe_key(wrapped[name][0])["wrapper"] == name
    # GPU runs keep their probe (the kit's plan has no time for one per wrapper)
    assert S.probe_key(spec(strategy="fsdp", world_size=2, device="cuda")) == "cuda-float32-t0-r2x4-tp1"


def test_the_sharding_term_is_the_wrapped_toy_steps_extra_cost_plus_its_copies_at_full_width():
    zero3 = spec(strategy="deepspeed", world_size=2, grad_accum=2, deepspeed=ZERO3)
    term = S.sharding_term(zero3, SHAPE, COUNTS, probe_for(zero3, flops_time))
    # 2 micro-steps x (wrapped 0.07 s - plain 0.04 s), + the step's gathered parameter bytes
    # (2 x 1024 elements x 4) and reduce-scattered gradient bytes (2 x GRADS) copied once at
    # 0.03 s per 2**24 bytes.
    assert term["parts"]["hooks"] == pytest.approx(2 * (0.07 - 0.04))
    assert term["parts"]["copies"] == pytest.approx(0.03 * (2 * 1024 * 4 + 2 * GRADS) / 2**24)
    assert term["seconds"] == pytest.approx(term["parts"]["hooks"] + term["parts"]["copies"])
    assert "wrapped by zero3" in term["how"]
    fsdp = spec(strategy="fsdp", world_size=2, grad_accum=2)
    term = S.sharding_term(fsdp, SHAPE, COUNTS, probe_for(fsdp, flops_time))
    # 3 units gathered twice a micro-batch (1048 x 4 bytes over the 3), reduce-scattered once a step.
    assert term["seconds"] == pytest.approx(2 * (0.05 - 0.04) + 0.03 * (2 * 2 * GRADS + GRADS) / 2**24)
    one_rank = spec(strategy="deepspeed", world_size=1, grad_accum=2, deepspeed=ZERO3)  # gathers nothing
    assert S.sharding_term(one_rank, SHAPE, COUNTS, probe_for(one_rank, flops_time))["seconds"] == \
        pytest.approx(2 * (0.07 - 0.04))


def test_runs_without_a_sharding_wrapper_are_predicted_as_before():
    for s in (spec(world_size=2), spec(strategy="deepspeed", world_size=2, deepspeed={"zero_stage": 2}),
              spec(strategy="tp", world_size=2)):
        assert S.sharding_term(s, SHAPE, COUNTS, probe_for(s, flops_time)) is None
        found = S.predict(s, SHAPE, COUNTS, probe_for(s, flops_time), collectives_file(), 2)
        assert set(found["terms"]) == {"compute", "communication", "optimizer", "bubble"}
    z3 = spec(strategy="deepspeed", world_size=2, deepspeed=ZERO3)
    found = S.predict(z3, SHAPE, COUNTS, probe_for(z3, flops_time), collectives_file(), 2)
    assert found["step_time_s"] == pytest.approx(sum(t["seconds"] for t in found["terms"].values()))
    assert found["terms"]["sharding"]["seconds"] > 0
    assert list(found["terms"]) == [t for t in predictions.TERMS if t in found["terms"]]  # the report's columns

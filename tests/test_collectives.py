"""The collective bandwidth benchmark's arithmetic (nccl-tests formulas) and the break-even
batch; the benchmark itself runs on real gloo ranks in the report pipeline (test_report)."""
from __future__ import annotations

import pytest
from distlab.records.spec import Spec

from distlab.records import collectives as readers
from distlab.tools import collectives as coll


def test_busbw_follows_the_nccl_tests_formulas():
    # 8 ranks, 1 GB in 0.1 s: algbw 10 GB/s for every op.
    assert coll.bandwidths("all_reduce", 1e9, 0.1, 8) == pytest.approx((1e10, 1e10 * 2 * 7 / 8))
    assert coll.bandwidths("all_gather", 1e9, 0.1, 8) == pytest.approx((1e10, 1e10 * 7 / 8))
    assert coll.bandwidths("reduce_scatter", 1e9, 0.1, 8) == pytest.approx((1e10, 1e10 * 7 / 8))


def test_message_sizes_sweep_from_min_to_max_by_factor():
    assert coll.message_sizes(1024, 16384, 4) == [1024, 4096, 16384]
    with pytest.raises(ValueError, match="bad size sweep"):
        coll.message_sizes(4096, 1024)


def test_huge_messages_get_fewer_timed_calls_but_never_under_three():
    assert coll.iterations_for(1024, 20) == 20
    assert coll.iterations_for(512 << 20, 20) == 3


def test_allreduce_time_is_interpolated_between_measured_sizes():
    result = {"results": [
        {"op": "all_reduce", "backend": "gloo", "status": "ok", "size_bytes": 1 << 20, "time_s_median": 0.001},
        {"op": "all_reduce", "backend": "gloo", "status": "ok", "size_bytes": 4 << 20, "time_s_median": 0.004},
    ]}
    assert readers.time_at(result, "all_reduce", "gloo", 2 << 20) == pytest.approx(0.002)
    assert readers.time_at(result, "all_reduce", "gloo", 8 << 20) == pytest.approx(0.008)  # constant bandwidth
    assert readers.time_at(result, "all_reduce", "nccl", 2 << 20) is None


def test_break_even_batch_is_where_n_ranks_and_one_take_equal_time():
    c, a, n = 0.05, 0.02, 2  # 50 ms compute per sample, 20 ms all-reduce
    b = readers.break_even_global_batch(c, a, n)
    assert b * c / n + a == pytest.approx(b * c)
    assert (b + 1) * c / n + a < (b + 1) * c  # above it, N ranks win
    with pytest.raises(ValueError):
        readers.break_even_global_batch(c, a, 1)


def test_single_tensor_collectives_fall_back_to_the_pre_2_13_names(monkeypatch):
    """torch 2.6-2.12 (the GPU box has 2.11) have no all_gather_single / reduce_scatter_single."""
    import torch
    import torch.distributed as dist

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    assert coll.single_tensor_collectives() == (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        call, size = coll._run_op("all_gather", 4096, torch.device("cpu"), 1)
        call()  # the benchmark's own call, through the fallback, on a real process group
        assert size == 4096
    finally:
        dist.destroy_process_group()


BENCH = {"world_size": None, "min_bytes": 1024, "max_bytes_cpu": 1 << 24, "max_bytes_cuda": 1 << 29, "factor": 4,
         "iters": 20, "warmup": 3}


def test_collectives_at_one_gpu_measure_gloo_and_record_why_nccl_is_skipped():
    specs = {"a": Spec({"device": "cuda", "world_size": 1})}
    one = coll.plan(BENCH, specs, gpu_count=1)
    assert one["device"] == "cpu" and one["gpus"] == 0 and one["world_size"] == 2
    assert "at least 2 GPUs; this machine has 1" in one["nccl_skipped"]
    two = coll.plan(BENCH, specs, gpu_count=2)
    assert (two["device"], two["gpus"], two["nccl_skipped"]) == ("cuda", 2, None)
    capped = coll.plan(dict(BENCH, world_size=8), specs, gpu_count=4)
    assert capped["world_size"] == capped["gpus"] == 4
    cpu = coll.plan(BENCH, {"a": Spec({"device": "cpu", "world_size": 2})}, gpu_count=0)
    assert (cpu["device"], cpu["gpus"], cpu["nccl_skipped"]) == ("cpu", 0, None)


def test_report_card_shows_the_skipped_nccl_reason():
    from distlab.report.build import collectives_card

    reason = coll.plan(BENCH, {"a": Spec({"device": "cuda", "world_size": 1})}, gpu_count=1)["nccl_skipped"]
    ok = {"backend": "gloo", "device": "cpu", "op": "all_reduce", "status": "ok", "size_bytes": 1024,
          "time_s_median": 1e-4, "algbw_bytes_per_s": 1e7, "busbw_bytes_per_s": 1e7}
    bench = {"box": {"world_size": 2, "device": "cpu", "results": [ok] + coll.skipped_rows(reason),
                     "how": "test", "versions": {"torch": "2.11"}, "threads_per_rank": 1}}
    card = collectives_card(bench, [])
    assert any("nccl all_reduce: skipped" in note and "at least 2 GPUs" in note for note in card.notes)

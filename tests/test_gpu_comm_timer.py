"""The DDP comm hook's in-flight time means what its label says on each device: host-clock
spans on gloo, CUDA-event spans on NCCL (enqueue time would be meaningless there), and the
union of the buckets' spans (queued buckets are not counted twice)."""
from __future__ import annotations

import types

import pytest
import torch

from distlab.strategies import ddp


def test_overlapping_bucket_spans_are_counted_once():
    assert ddp.union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert ddp.union_length([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)
    assert ddp.union_length([]) == 0.0


class FakeEvent:
    """torch.cuda.Event stand-in: record() stamps the fake GPU clock (ms)."""
    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.at = None

    def record(self):
        self.at = FakeEvent.clock_ms

    def elapsed_time(self, other):
        return other.at - self.at


def test_on_cuda_the_marks_are_cuda_events_not_host_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = ddp.CommTimer()
    cuda = types.SimpleNamespace(type="cuda")
    for start_ms, end_ms in [(0.0, 4.0), (1.0, 6.0)]:  # bucket 2 queued behind bucket 1
        FakeEvent.clock_ms = start_ms
        start = timer.mark(cuda)
        FakeEvent.clock_ms = end_ms
        timer.add(start, timer.mark(cuda))
    assert isinstance(start, FakeEvent)
    assert timer.seconds == pytest.approx(0.006) and timer.buckets == 2
    timer.seconds = 0.0  # how the strategies take the step's value
    assert timer.seconds == 0.0
    assert "CUDA events" in ddp.CommTimer.HOW["cuda"]


def test_on_cpu_the_hook_times_a_real_gloo_allreduce():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        timer = ddp.CommTimer()
        bucket = types.SimpleNamespace(buffer=lambda: torch.ones(1 << 16))
        out = ddp.timed_allreduce_hook(timer, bucket).wait()
        assert torch.equal(out, torch.ones(1 << 16))
        assert timer.buckets == 1 and timer.seconds > 0
    finally:
        dist.destroy_process_group()

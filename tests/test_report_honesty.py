"""Every figure and sentence a card prints is computed from the runs it describes, and a
goal's status says what was checked (passed / failed / not run / compared, not enforced)."""
from __future__ import annotations

from card_runs import fake_run


def test_a_comm_time_that_was_not_measured_prints_as_not_measured_never_zero(tmp_path):
    from distlab.report.cards import stage1_ddp

    one = fake_run(tmp_path / "a", {"world_size": 1, "micro_batch": 8}, comm_median_s=0.0)
    two = fake_run(tmp_path / "b", {"world_size": 2, "micro_batch": 4}, comm_median_s=None)
    (table,) = [t for t in stage1_ddp.build([one, two]).tables]
    cells = list(table.frame["all-reduce in flight (ms/step)"])
    assert cells == [0.0, "not measured"]


def test_fsdp_through_accelerate_reports_no_comm_time_rather_than_zero():
    from distlab.strategies.accelerate import AccelerateStrategy
    from distlab.strategies.base import RunContext

    strategy = AccelerateStrategy.__new__(AccelerateStrategy)
    strategy.ctx, strategy.hook, strategy.fsdp = RunContext(spec={}, run_dir="", device=None, world_size=2), None, True
    assert strategy.take_comm_seconds() is None and strategy.comm_unmeasured_reason

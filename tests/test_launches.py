"""Spec `launches`: independent launches of one experiment (fresh processes each), so the
report's spread is run-to-run variance, not the windows of one process."""
import pytest

from conftest import resolve, run_experiment


@pytest.mark.slow
def test_further_launches_time_the_same_work_and_give_the_spread(prepared, tmp_path):
    from distlab.report.cards import spread_caveat
    from distlab.report.collect import throughput_stats

    run = run_experiment(prepared, tmp_path / "run", resolve({"world_size": 1, "micro_batch": 4, "launches": 2},
                                                             steps=4, untimed_steps=2), checkpoint=False)
    first, second = run["launches"]
    assert first["tokens_per_s"] == run["throughput"]["tokens_per_s"]
    assert second["loss_last"] == pytest.approx(first["loss_last"], abs=1e-6)  # the same work, again
    assert second["noise"]["window_s"] > 0  # its own timed steps, its own machine record
    assert not list(tmp_path.joinpath("run").glob("launch-*"))  # folded into metrics.json, folders gone
    stats = throughput_stats(dict(run, _steps=[]))
    assert stats["launches"] == 2 and stats["low"] == min(first["tokens_per_s"], second["tokens_per_s"])
    assert "separate launches" in spread_caveat([run]) and "not measured" in spread_caveat([run, {"launches": []}])

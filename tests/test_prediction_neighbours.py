"""What rank 0 tells the step-time prediction about the machine before the first step: the cores
other processes kept busy since the rank started (distlab.rank.worker), which places a run that
leaves cores free between its kernels alone and beside (distlab.tools.step_time.neighbour_share)."""
from __future__ import annotations

from types import SimpleNamespace

from distlab.rank import worker
from distlab.records.spec import Spec


class Window:
    """A NoiseProbe window: 2 s of wall time, 3 CPU-s of the machine's, 1 CPU-s of rank 0's."""

    def stop(self):
        return {"wall_s": 2.0, "machine_cpu_s": 3.0, "own_cpu_s": 1.0, "load_avg_1min": [1.0, 1.0]}


def test_rank_zero_counts_what_other_processes_used_since_it_started_besides_its_own_ranks(monkeypatch):
    seen = []
    monkeypatch.setattr("distlab.tools.step_time.predict_from_files", lambda *args: seen.append(args[-1]) or {})

    def job(world):
        return SimpleNamespace(spec=Spec({"world_size": world}), model_source=None, probe_json=None,
                               collectives_json=None,
                               hardware_json=None)

    worker.predicted_step_time(job(1), Window())
    worker.predicted_step_time(job(2), Window())  # the other rank counted as using what rank 0 used
    assert seen == [(3.0 - 1.0) / 2.0, (3.0 - 2 * 1.0) / 2.0]

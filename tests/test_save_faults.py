"""A full disk costs one save only: when rank 0's write of the native state raises ENOSPC, every
rank reaches the same collectives and raises the same SaveFailed within seconds, and the run
goes on to its next periodic save, which completes (2 gloo ranks, the formats' own code)."""
from __future__ import annotations

import errno
import json
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest

# A rank left waiting in a collective fails after this long: well under the test's wait.
GROUP_TIMEOUT_S = 40


class StandInStrategy:
    """What TrainingCheckpoints asks of a strategy, around a tiny model whose every rank holds
    the whole of it; saved in the named native format (plain: DDP's, dcp: FSDP/TP/PP's)."""

    name = "ddp"
    scheduler = None
    task = None
    rank_batches = None

    def __init__(self, native_format: str):
        import torch
        import torch.distributed as dist

        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.ones(2, 4)).sum().backward()
        self.optimizer.step()
        self.native_format = native_format
        self.data_parallel_rank, self.data_parallel_size = dist.get_rank(), dist.get_world_size()

    def unwrapped(self):
        return self.model

    def save_checkpoint(self, path: str) -> None:
        from distlab.checkpoint_formats.dcp import dcp_save
        from distlab.checkpoint_formats.plain import save_plain

        (save_plain if self.native_format == "plain" else dcp_save)(self, path)


def fill_the_disk_once(native_format: str):
    """Rank 0's first native-state write raises ENOSPC (plain: the optimizer file; dcp: the
    format file rank 0 writes after the shards); later ones succeed (space was freed)."""
    import torch

    import distlab.checkpoint_formats.dcp as dcp_format

    owner, name = (torch, "save") if native_format == "plain" else (dcp_format, "write_format")
    original = getattr(owner, name)
    full = [True]

    def write(*args, **kwargs):
        if full[0]:
            full[0] = False
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(*args, **kwargs)

    setattr(owner, name, write)


def train_with_periodic_saves(rank: int, native_format: str, spec: dict, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from distlab.records.job import Job
    from distlab.rank.training_checkpoints import TrainingCheckpoints
    from distlab.strategies.base import RunContext

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    run = Path(folder) / "run"
    job = Job(spec=spec, run_dir=str(run), checkpoint_dir=str(run / "checkpoint"))
    ctx = RunContext(spec=job.spec, run_dir=str(run), device=torch.device("cpu"), rank=rank, world_size=2, job=job)
    checkpoints = TrainingCheckpoints(job, ctx, StandInStrategy(native_format), {"config": {}, "parameters": {}},
                                      n_samples=64)
    if rank == 0:
        fill_the_disk_once(native_format)
    for step in range(spec["steps"]):
        checkpoints.on_step_end(step)
    report = {**checkpoints.report, "steps_run": spec["steps"]}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("native_format", ["plain", "dcp"])
def test_a_full_disk_in_rank_0s_native_write_fails_that_save_on_every_rank_and_training_goes_on(native_format,
                                                                                              tmp_path):
    from conftest import resolve

    # Periodic saves at steps 2 and 4 (4 is also the parity save); the first meets a full disk.
    spec = resolve({"world_size": 2, "micro_batch": 4, "checkpoint_every": 2, "checkpoint_keep": 2}, steps=6)
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=train_with_periodic_saves, args=(rank, native_format, spec, str(tmp_path)))
             for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=3 * GROUP_TIMEOUT_S)
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for process in ranks:
        process.kill() if process.is_alive() else None
    assert not hung, f"rank(s) {hung} still in the save"
    assert [process.exitcode for process in ranks] == [0, 0]

    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        (failed,) = report["failed_saves"]
        assert failed["steps_done"] == 2
        # Every rank names rank 0's full disk, and no rank failed waiting for another.
        assert f"rank 0: OSError: [Errno {errno.ENOSPC}]" in failed["error"], failed
        assert "rank 1:" not in failed["error"], failed
        assert [save["steps_done"] for save in report["periodic_saves"]] == [4]
    resume = tmp_path / "run" / "resume"
    assert sorted(p.name for p in resume.iterdir()) == ["step-000004"]
    assert (resume / "step-000004" / "MANIFEST.json").is_file()
    assert json.loads((resume / "step-000004" / "state" / "format.json").read_text())["format"] == native_format


def test_deepspeeds_writes_keep_their_error_until_its_save_has_passed_its_barriers(tmp_path):
    """DeepSpeed's save_checkpoint barriers after its writes: zero_save makes the checkpoint
    engine's writes keep their error (raised by every rank afterwards), so the rank whose disk
    filled still reaches those barriers; nothing more is written once one failed."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from distlab.checkpoint_formats.zero import deferred_write_errors

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

    engine = Engine()
    full = tmp_path / "full"
    full.write_text("")  # a file where a folder is wanted: the write raises
    with deferred_write_errors(engine) as errors:
        engine.checkpoint_engine.save({"x": 1}, str(full / "mp_rank_00_model_states.pt"))
        engine.checkpoint_engine.save({"x": 1}, str(tmp_path / "after.pt"))
        engine.checkpoint_engine.makedirs(str(tmp_path / "later"), exist_ok=True)
    assert len(errors) == 1 and isinstance(errors[0], OSError)
    assert not (tmp_path / "after.pt").exists() and not (tmp_path / "later").exists()
    # Outside the save, the engine writes (and raises) as DeepSpeed made it.
    assert "save" not in vars(engine.checkpoint_engine)
    with pytest.raises(OSError):
        engine.checkpoint_engine.save({"x": 1}, str(full / "again.pt"))


def test_a_rank_waits_in_a_collective_no_longer_than_its_job_may_run(monkeypatch):
    """The process group's timeout is the job's runtime (Snakemake's `runtime` resource, or the
    rule's own estimate for a launch outside a rule), not gloo's fixed 30 minutes."""
    import torch
    import torch.distributed as dist
    from conftest import resolve

    from distlab.records.job import Job, estimated_runtime_minutes
    from distlab.strategies.base import RunContext
    from distlab.strategies.ddp import DDPStrategy

    spec = resolve({"world_size": 1}, steps=120)
    asked = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: asked.update(kwargs))
    for runtime, minutes in ((7, 7), (None, estimated_runtime_minutes(spec))):
        job = Job(spec=spec, run_dir="run", runtime_minutes=runtime)
        DDPStrategy(RunContext(spec=job.spec, run_dir="run", device=torch.device("cpu"), job=job)).init_distributed()
        assert asked["timeout"] == timedelta(minutes=minutes)
    assert estimated_runtime_minutes(spec) == 12  # 10 + 120 steps // 60, as the train rule's runtime

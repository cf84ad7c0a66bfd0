"""Ray Train worker side of the `ray` launcher: what each worker process runs.

`train_worker` is the TorchTrainer training function: distlab.rank.worker.run_rank with
checkpoints that Ray knows about (every periodic checkpoint is reported with
`ray.train.report`; a restarted or resized group resumes from `ray.train.get_checkpoint()`).
Events go to the driver's RunLog actor (distlab.rank.ray_train), so no shared
filesystem is needed for them.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def node_identity() -> dict:
    import ray

    # No host name; the IP address reaches only the driver, which writes a host label in its
    # place (ray_record.host_labels): results/<machine>/ names no machine (distlab.records.sharing).
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid()}


def _ray_checkpoints_class():
    """TrainingCheckpoints (distlab.rank.training_checkpoints) that also tells Ray about every checkpoint and
    resumes from the one Ray hands back; built on first use so that importing this module
    (the Ray driver does, to hand Ray `train_worker`) loads neither torch
    nor Ray."""
    import ray
    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint

    from distlab.checkpoints import checkpoint as ckpt
    from distlab.rank.training_checkpoints import TrainingCheckpoints

    class RayCheckpoints(TrainingCheckpoints):
        run_log = None  # the driver's RunLog actor, set by train_worker
        prune_after_save = False  # pruned after ray.train.report: Ray resumes from what it was told of

        def resume(self) -> int:
            found = ray.train.get_checkpoint()
            if found is None:
                steps = super().resume()  # a rerun of a killed Snakemake job may still resume from resume/
                self._log_start(steps, None)
                return steps
            with found.as_directory() as folder:
                meta = ckpt.read_meta(folder)
                same_world = meta["world_size"] == dist.get_world_size()
                # Same world size: the exact trainer state (data position, RNG, records). After an
                # elastic resize only the model and optimizer carry over; the data is re-sharded.
                info = ckpt.load_checkpoint(folder, self.strategy, self.ctx, self.signature,
                                            stream=self.stream if same_world else None,
                                            allow_world_size=not same_world)
                earlier = [] if same_world else earlier_losses(Path(folder), meta["world_size"])
            steps = info["steps_done"]
            if same_world:
                self.records[:] = info["records"]
            else:
                for _ in range(steps * self.spec.grad_accum):
                    self.stream.next()
                # This group times only its own steps: keep at least one after its warm-up. The
                # loop and the run summary read what the context times (the spec stays the job's).
                self.ctx.untimed_steps = min(self.spec.untimed_steps, max(0, self.spec.steps - steps - 1))
            self.report["resumed_from_steps"] = steps
            self._log_start(steps, {"from_world_size": meta["world_size"], "earlier_losses": earlier})
            return steps

        def _log_start(self, steps: int, restored: dict | None) -> None:
            event = {"event": "rank_started", "time": time.time(), "rank": dist.get_rank(),
                     "world_size": dist.get_world_size(), "start_step": steps, "resumed": restored is not None,
                     **node_identity()}
            if restored and dist.get_rank() == 0:
                event.update(restored)
            ray.get(self.run_log.add.remote(event))

        def on_step_end(self, step: int) -> None:
            # The fault-injection test hook (distlab.checkpoints.checkpoint.FAULT_ENV) fires here instead,
            # after Ray has been told of this step's checkpoint, and once per run: a group that
            # resumes before the step must not be killed again.
            fault = os.environ.pop(ckpt.FAULT_ENV, None) or getattr(self, "fault", None)
            self.fault = fault
            saves = len(self.report["periodic_saves"])
            super().on_step_end(step)
            done = step + 1
            if len(self.report["periodic_saves"]) > saves:
                folder = self.resume_root / f"step-{done:06d}"
                ray.train.report({"steps_done": done, "world_size": dist.get_world_size()},
                                 checkpoint=Checkpoint.from_directory(str(folder)) if dist.get_rank() == 0 else None,
                                 checkpoint_dir_name=f"step-{done:06d}")
                self.prune()  # now the checkpoint Ray resumes from is the new one
                if dist.get_rank() == 0:
                    ray.get(self.run_log.add.remote({"event": "checkpoint", "time": time.time(), "steps_done": done,
                                                     "world_size": dist.get_world_size()}))
            if fault and fault.rsplit(":", 2) == [self.spec.id, str(dist.get_rank()), str(done)] \
                    and not ray.get(self.run_log.count.remote("fault_injected")):
                ray.get(self.run_log.add.remote({"event": "fault_injected", "time": time.time(),
                                                 "rank": dist.get_rank(), "steps_done": done, "signal": "SIGKILL",
                                                 **node_identity()}))
                os.environ[ckpt.FAULT_ENV] = fault
                ckpt.maybe_inject_fault(self.spec, done)

    return RayCheckpoints


def earlier_losses(folder: Path, world_size: int) -> list[dict]:
    """Mean loss per step over the ranks of the world a checkpoint was saved in (its
    trainer/rank<R>.json records), for the curve across an elastic resize."""
    per_rank = [json.loads((folder / "trainer" / f"rank{r}.json").read_text())["records"] for r in range(world_size)]
    rows = []
    for i, record in enumerate(per_rank[0]):
        values = [recs[i]["loss"] for recs in per_rank if recs[i]["loss"] is not None]
        rows.append({"step": record["step"], "loss": sum(values) / len(values) if values else None,
                     "step_time_s": max(recs[i]["step_time_s"] for recs in per_rank), "world_size": world_size})
    return rows


def train_worker(config: dict):
    """What every Ray Train worker runs: distlab.rank.worker.run_rank with Ray-aware checkpoints."""
    import ray
    import ray.train
    import torch

    from distlab.rank import worker
    from distlab.records.job import replace
    from distlab.records.sharing import private_files

    private_files()  # a worker on a node `ray start` began writes as the ranks do (distlab.records.sharing)
    # An elastic group may hold fewer than max_workers: the rank code checks the world size
    # it really got against this group's size (Ray checked it is within [min, max]).
    job = config["job"]
    spec = job.spec.replace(world_size=ray.train.get_context().get_world_size())
    job = replace(job, spec=spec)
    if spec.device == "cuda":
        import ray.train.torch

        # Ray gives each worker its GPU and may share CUDA_VISIBLE_DEVICES between the
        # workers of a node; LOCAL_RANK must name the device Ray chose, whose index in
        # that list need not equal the local rank.
        os.environ["LOCAL_RANK"] = str(ray.train.torch.get_device().index)
    checkpoints_class = _ray_checkpoints_class()
    checkpoints_class.run_log = config["log"]
    try:
        summary = worker.run_rank(job, checkpoints_class=checkpoints_class)
    except torch.OutOfMemoryError as error:
        ray.get(config["log"].add.remote({"event": "oom", "rank": ray.train.get_context().get_world_rank(),
                                          "time": time.time(), "error": str(error).splitlines()[0][:500]}))
        raise
    return None if summary is None else dict(zip(("metrics", "steps"), summary))

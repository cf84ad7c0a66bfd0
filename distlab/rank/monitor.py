"""What a run reports while it trains, between optimizer steps (never inside a step's timer):

- every step, one small all-gather gives every rank the step's global figures (mean loss over
  the ranks that have one, the slowest rank's step time, the largest memory); they join the
  rank's record, so a resumed run replays them exactly;
- eval points (eval_every): held-out loss and perplexity of the model so far
  (Strategy.evaluate, collective), and with checkpoint_select best the checkpoint of the
  best one (distlab.checkpoints.checkpoint.save_checkpoint, with its export);
- rank 0 prints progress into the job log every progress_every_s seconds (step/total, loss,
  learning rate, tokens/s, elapsed, ETA) and feeds the trackers (distlab.runtime.tracking) then.
  Whenever rank 0 did such work, every rank waits for it at a barrier, so it is not billed to
  the other ranks' next step.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.records.job import Job
from distlab.runtime.tracking import Trackers, step_values

BEST = "best"  # checkpoint/best/ (the selected model of checkpoint_select: best)


def memory_now(device) -> int | None:
    """This rank's peak memory so far in training: CUDA allocator peak, else VmHWM (RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    from distlab.runtime.memory import process_status

    return process_status().get("VmHWM")


def clock(seconds: float) -> str:
    return str(timedelta(seconds=int(round(seconds))))


class RunMonitor:
    """Every rank builds one; the worker calls after_step (collective) from the loop's
    on_step_end and finish() after the last step."""

    def __init__(self, job: Job, ctx, strategy, records: list, start_step: int, checkpoints=None):
        from distlab.configuration.finetune_config import data_parallel_size

        self.job, self.ctx, self.strategy, self.records = job, ctx, strategy, records
        self.spec = spec = job.spec
        self.checkpoints = checkpoints
        self.start_step = start_step
        # Throughput in the task's unit: tokens (causal LM) or images (text-to-image).
        self.unit = strategy.task.unit
        self.units_per_step = (spec.micro_batch * spec.grad_accum * data_parallel_size(spec)
                               * strategy.task.units_per_sample(spec))
        self.every_s = spec.progress_every_s
        self.main = dist.get_rank() == 0
        self.started = self.last_flush = time.perf_counter()
        self.last_flush_step = start_step
        self.pending: list[tuple[int, dict]] = []
        self.trackers = Trackers(job, start_step) if self.main and spec.tracking else None
        self.eval_tokens = None
        if spec.eval_every:
            from distlab.runtime.evaluation import eval_positions, eval_tokens

            self.eval_tokens = (*eval_tokens(job.data_dir), eval_positions(job.data_dir))
        # Eval points already made before a resume (rank 0's records hold them).
        self.best = min((r["eval"] for r in records if r.get("eval")), key=lambda e: e["loss"], default=None)
        if self.trackers is not None:
            for record in records[:start_step]:  # a resumed launch's trackers hold the whole curve
                self.pending.append((record["step"], step_values(self.row(record))))
        if self.main:
            print(f"progress: training steps {start_step}..{spec.steps - 1} of {spec.steps}, "
                  f"{self.units_per_step:,} {self.unit}s per step", flush=True)

    def row(self, record: dict) -> dict:
        """A record's global figures, as steps.jsonl and the trackers show them."""
        glob = record.get("global") or {}
        step_time = glob.get("step_time_s")
        ev = record.get("eval") or {}
        return {"loss": glob.get("loss"), "lr": record.get("lr"), "grad_norm": record.get("grad_norm"),
                "step_time_s": step_time, f"{self.unit}s_per_s": self.units_per_step / step_time if step_time else None,
                "memory_bytes": glob.get("memory_bytes"), "eval_loss": ev.get("loss"),
                "eval_perplexity": ev.get("perplexity")}

    def after_step(self, step: int) -> None:
        record = self.records[-1]
        record["memory_bytes"] = memory_now(self.ctx.device)
        last = step == self.spec.steps - 1
        due = self.main and (last or (self.every_s > 0 and time.perf_counter() - self.last_flush >= self.every_s))
        loss = record["loss"]
        mine = torch.tensor([math.nan if loss is None else loss, loss is not None, record["step_time_s"],
                             record["memory_bytes"] or 0, due], dtype=torch.float64)
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = torch.stack(rows)
        with_loss = table[table[:, 1] > 0, 0].tolist()
        record["global"] = {"loss": sum(with_loss) / len(with_loss) if with_loss else None,
                            "step_time_s": float(table[:, 2].max()), "memory_bytes": int(table[:, 3].max())}
        flush = bool(table[0, 4])
        done = step + 1
        if self.eval_tokens is not None and (done % self.spec.eval_every == 0 or last):
            self._eval_point(record, done)
        if self.trackers is not None:
            self.pending.append((step, step_values(self.row(record))))
        if flush:
            if self.main:
                self._flush(step)
            dist.barrier()

    def _eval_point(self, record: dict, done: int) -> None:
        """Collective: the eval point after `done` steps; rank 0's result goes to every rank."""
        result = [self.strategy.evaluate(*self.eval_tokens)]
        dist.broadcast_object_list(result, src=0)
        point = {"step": done - 1, "steps_done": done, **result[0]}
        record["eval"] = point
        if self.main:
            print(f"eval: after {done} steps held-out loss {point['loss']:.4f} perplexity {point['perplexity']:.2f} "
                  f"({point['tokens']} tokens)", flush=True)
        if self.spec.checkpoint_select == BEST and (self.best is None or point["loss"] < self.best["loss"]):
            self.best = point
            self._save_best(done)

    def _save_best(self, done: int) -> None:
        """The best eval point's checkpoint (with export) in <run>/best-checkpoint/ while training
        (it outlives a crash, like resume/); finish() moves it into checkpoint/best/."""
        from distlab.checkpoints import checkpoint as ckpt

        if self.checkpoints is None or not self.checkpoints.enabled:
            return
        ckpt.save_checkpoint(Path(self.job.run_dir) / "best-checkpoint", self.strategy, self.ctx, self.job,
                             self.checkpoints.signature, done, self.checkpoints.stream, self.records, export=True)

    def _flush(self, step: int) -> None:
        now = time.perf_counter()
        rec = self.records[-1]
        glob = rec["global"]
        steps = step + 1 - self.last_flush_step
        rate = self.units_per_step * steps / (now - self.last_flush) if now > self.last_flush else 0.0
        done_here = step + 1 - self.start_step
        eta = (now - self.started) / done_here * (self.spec.steps - step - 1)
        loss = "n/a" if glob["loss"] is None else f"{glob['loss']:.4f}"
        norm = "" if rec.get("grad_norm") is None else f" grad_norm {rec['grad_norm']:.3g}"
        print(f"progress: step {step + 1}/{self.spec.steps} ({(step + 1) / self.spec.steps:.0%}) loss {loss} "
              f"lr {rec['lr']:.3g}{norm} {self.unit}s/s {rate:,.0f} elapsed {clock(now - self.started)} ETA "
              f"{clock(eta)}",
              flush=True)
        if self.trackers is not None:
            self.trackers.log(self.pending)
            self.pending.clear()
        self.last_flush, self.last_flush_step = time.perf_counter(), step + 1

    def finish(self) -> dict:
        """Collective. After the last step: the trackers closed, the best checkpoint moved into
        checkpoint/best/; returns what metrics.json records (meaningful on rank 0)."""
        out = {"eval_points": [r["eval"] for r in self.records if r.get("eval")]}
        if self.spec.checkpoint_select == BEST:
            out["selected"] = self._select_best()
        if self.trackers is not None:
            self.trackers.log(self.pending)
            out["tracking"] = self.trackers.finish()
        dist.barrier()
        return out

    def _select_best(self) -> dict:
        staged = Path(self.job.run_dir) / "best-checkpoint"
        best = dict(self.best or {}, select=BEST)
        if self.checkpoints is None or not self.checkpoints.enabled:
            return {**best, "checkpoint": None, "reason": "this launch saves no checkpoints"}
        dest = Path(self.job.checkpoint_dir) / BEST
        if self.main and staged.is_dir():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.move(str(staged), dest)
            meta = json.loads((dest / "distlab_checkpoint.json").read_text())
            best["checkpoint"] = str(dest)
            best["checkpoint_steps_done"] = meta["steps_done"]
        return best


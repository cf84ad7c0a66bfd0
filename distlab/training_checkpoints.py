"""A rank's checkpoint duties during training (the folder layout and trainer state are in
distlab/checkpoint.py): resume from resume/, the periodic and parity saves (the newest
`checkpoint_keep` periodic ones kept), the final save, and what a failed save leaves."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from distlab import checkpoint as ckpt
from distlab.loop import IndexStream


class TrainingCheckpoints:
    """This rank's checkpoint duties (layout in distlab/checkpoint.py): resume from resume/,
    periodic and parity saves, the final save into checkpoint/. Every method is collective."""

    def __init__(self, job: dict, ctx, strategy, signature: dict, n_samples: int):
        self.job, self.ctx, self.strategy, self.signature = job, ctx, strategy, signature
        self.spec = spec = ctx.spec
        self.enabled = bool(job.get("checkpoint_dir"))
        self.resume_root = Path(job["run_dir"]) / "resume"
        self.parity_step = spec["steps"] - ckpt.PARITY_STEPS if spec["steps"] > ckpt.PARITY_STEPS else None
        self.stream = IndexStream(n_samples, spec, strategy.data_parallel_rank, strategy.data_parallel_size,
                                  getattr(strategy, "rank_batches", None))
        self.records: list = []
        self.unsupported = None
        self.report = {"resumed_from_steps": None, "skipped": [], "periodic_saves": [], "failed_saves": []}
        self._base = None

    @property
    def base(self) -> dict | None:
        """A LoRA run's frozen base by identity (checkpoint.base_identity), read once, on first
        use (collective: resume and every save run on all ranks)."""
        if self.spec["method"] == "lora" and self._base is None:
            source = self.job["model_source"]
            self._base = ckpt.base_identity(source, self.strategy.task.weights_folder(source))
        return self._base

    def _log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(f"checkpoint: {message}", flush=True)

    def resume(self) -> int:
        """Steps already done: those of the newest resume/ checkpoint that loads, else 0."""
        if not self.enabled or not self.resume_root.is_dir():
            return 0
        found = sorted(p for p in self.resume_root.glob("step-*") if p.name.split("-")[1].isdigit())
        for path in reversed(found):
            try:
                info = ckpt.load_checkpoint(path, self.strategy, self.ctx, self.signature, stream=self.stream,
                                            base=self.base)
            except ckpt.BaseMismatch as exc:
                # Hours of adapters are not thrown away for a base that changed under them: the
                # run stops, naming both bases; the user restores the base or removes resume/.
                self._log(f"refusing to resume from {path}: {exc}")
                raise
            except ckpt.CheckpointError as exc:
                self._log(f"not resuming from {path}: {exc}")
                self.report["skipped"].append(str(exc))
                dist.barrier()
                if dist.get_rank() == 0:
                    shutil.rmtree(path)  # unusable for this config; a fresh save replaces it
                continue
            self.records[:] = info["records"]
            self.report["resumed_from_steps"] = info["steps_done"]
            self._log(f"resumed from {path} ({info['steps_done']} steps done)")
            return info["steps_done"]
        return 0

    # Ray's launcher prunes only once Ray was told of the newer checkpoint (it resumes from the
    # newest one it knows of, which must still exist).
    prune_after_save = True

    def prune(self) -> None:
        """Rank 0 removes all but the newest `checkpoint_keep` periodic checkpoints."""
        if dist.get_rank() == 0:
            prune_periodic(self.resume_root, self.spec.get("checkpoint_keep", 1), self.parity_step)

    def on_step_end(self, step: int) -> None:
        done = step + 1
        every = self.spec["checkpoint_every"]
        due = done == self.parity_step or (every and done % every == 0)
        if self.enabled and self.unsupported is None and due and done < self.spec["steps"]:
            path = self.resume_root / f"step-{done:06d}"
            try:
                info = ckpt.save_checkpoint(path, self.strategy, self.ctx, self.job, self.signature, done,
                                            self.stream, self.records, base=self.base)
                self.report["periodic_saves"].append({"steps_done": done, "save_seconds": info["save_seconds"],
                                                      "bytes": info.get("bytes")})
                if self.prune_after_save:
                    self.prune()
            except NotImplementedError as exc:
                self.unsupported = str(exc)
                self._log(f"periodic checkpoints off: {exc}")
            except ckpt.SaveFailed as exc:  # the run goes on; the newest complete save stays the resume point
                self.report["failed_saves"].append({"steps_done": done, "error": str(exc)})
                self._log(f"periodic save at step {done} failed, training goes on: {exc}")
        ckpt.maybe_inject_fault(self.spec, done)

    def save_final(self) -> dict | None:
        """The final save (with the export); the parity checkpoint joins it; resume/ goes. A
        failed save leaves checkpoint/FAILED.json (checkpoint/ is a declared output of the
        train rule: present, so the job and its figures stand) and keeps resume/ for a rerun."""
        if not self.enabled:
            return None
        root = Path(self.job["checkpoint_dir"])
        try:
            info = ckpt.save_checkpoint(root / "final", self.strategy, self.ctx, self.job, self.signature,
                                        self.spec["steps"], self.stream, self.records, export=True, base=self.base)
        except NotImplementedError as exc:
            if dist.get_rank() == 0:
                root.mkdir(parents=True, exist_ok=True)
                (root / "UNSUPPORTED.json").write_text(json.dumps({"reason": str(exc)}))
            dist.barrier()
            return {"status": "unsupported", "reason": str(exc), **self.report}
        except ckpt.SaveFailed as exc:
            self._log(f"the final save failed; the run's figures stand, its checkpoint does not: {exc}")
            if dist.get_rank() == 0:
                root.mkdir(parents=True, exist_ok=True)
                (root / FAILED).write_text(json.dumps({"status": "failed", "error": str(exc)}, indent=1))
            dist.barrier()
            return {"status": "failed", "error": str(exc), **self.report}
        if dist.get_rank() == 0 and self.parity_step:
            parity = self.resume_root / f"step-{self.parity_step:06d}"
            if parity.is_dir():
                shutil.rmtree(root / parity.name, ignore_errors=True)
                os.replace(parity, root / parity.name)
            shutil.rmtree(self.resume_root, ignore_errors=True)
        elif dist.get_rank() == 0:
            shutil.rmtree(self.resume_root, ignore_errors=True)
        dist.barrier()
        return {"status": "saved", "path": str(root / "final"), **info, **self.report,
                "parity_checkpoint": f"step-{self.parity_step:06d}" if self.parity_step else None}


FAILED = "FAILED.json"  # in checkpoint/ when the final save failed (its error inside)


def prune_periodic(resume_root: Path, keep: int, parity_step: int | None) -> list[str]:
    """Keep the newest `keep` complete periodic checkpoints (and the parity one validation
    resumes from); remove the rest. Returns the names removed."""
    found = sorted(p for p in resume_root.glob("step-*") if p.name.split("-")[1].isdigit())
    parity = f"step-{parity_step:06d}" if parity_step else None
    periodic = [p for p in found if p.name != parity]
    removed = periodic[:-keep] if keep > 0 else periodic
    for old in removed:
        shutil.rmtree(old)
    return [p.name for p in removed]

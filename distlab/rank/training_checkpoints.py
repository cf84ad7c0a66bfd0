"""A rank's checkpoint duties during training (the folder layout and trainer state are in
distlab/checkpoints/checkpoint.py): resume from resume/, the periodic and parity saves (the newest
`checkpoint_keep` periodic ones kept), the final save, and what a failed save leaves."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from distlab.configuration.training_tools import adapts
from distlab.checkpoints import checkpoint as ckpt
from distlab.records.checkpoint_files import step_folders
from distlab.records.job import Job
from distlab.rank.loop import IndexStream
from distlab.records.sharing import portable


class TrainingCheckpoints:
    """This rank's checkpoint duties (layout in distlab/checkpoints/checkpoint.py): resume from resume/,
    periodic and parity saves, the final save into checkpoint/. Every method is collective."""

    def __init__(self, job: Job, ctx, strategy, signature: dict, n_samples: int):
        self.job, self.ctx, self.strategy, self.signature = job, ctx, strategy, signature
        self.spec = spec = ctx.spec
        self.enabled = bool(job.checkpoint_dir)
        self.resume_root = Path(job.run_dir) / "resume"
        self.parity_step = spec.steps - ckpt.PARITY_STEPS if spec.steps > ckpt.PARITY_STEPS else None
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
        if adapts(self.spec) and self._base is None:
            source = self.job.model_source
            self._base = ckpt.base_identity(source, self.strategy.task.weights_folder(source))
        return self._base

    def _log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(f"checkpoint: {portable(message)}", flush=True)

    def resume(self) -> int:
        """Steps already done: those of the newest resume/ checkpoint that loads, else 0.

        A checkpoint is never deleted for being refused: it moves into refused-checkpoints/ with
        its reason (set_aside), named in this launch's log and in every later one's. Refused
        before anything was loaded from it (altered or truncated files, another config, model or
        world size): the next older one is tried, else training starts from step 0. Failed while
        loading (its state may be half in the model): the run stops naming it; the rerun resumes
        from an older one or starts fresh, and never meets it again. LoRA adapters of another
        base stop the run and stay where they are (BaseMismatch)."""
        if not self.enabled:
            return 0
        if dist.get_rank() == 0:
            for earlier in refused_earlier(self.resume_root.parent):
                print(f"checkpoint: {portable(earlier)}", flush=True)
        found = step_folders(self.resume_root)
        for path in reversed(found):
            try:
                ckpt.check_loadable(path, self.spec, self.signature, base=self.base,
                                    trainer_world_size=dist.get_world_size())
            except ckpt.BaseMismatch as exc:
                # Hours of adapters are not thrown away for a base that changed under them: the
                # run stops, naming both bases; the user restores the base or removes resume/.
                self._log(f"refusing to resume from {path}: {exc}")
                raise
            except ckpt.CheckpointError as exc:
                dist.barrier()  # every rank has read it
                kept = set_aside(path, str(exc)) if dist.get_rank() == 0 else None
                self._log(f"not resuming from {path}: {exc}; kept as {kept}")
                self.report["skipped"].append(f"{exc} (kept as {kept})")
                continue
            try:
                info = ckpt.load_checkpoint(path, self.strategy, self.ctx, self.signature, stream=self.stream,
                                            verify=False, base=self.base)
            except Exception as exc:
                from distlab.runtime.memory import is_out_of_memory

                if is_out_of_memory(exc):
                    raise
                reason = f"{type(exc).__name__}: {exc}"[:1000]
                kept = set_aside(path, f"loading it failed: {reason}")  # the rank that failed: it may be alone
                raise ResumeFailed(f"resuming from {path} failed while loading it ({reason}); the model may hold "
                                   f"part of it, so this launch stops. It was moved to {kept} (kept, not deleted): "
                                   f"rerun the job and it resumes from an older checkpoint in {self.resume_root} "
                                   "or, with none left, trains from step 0") from exc
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
            prune_periodic(self.resume_root, self.spec.checkpoint_keep, self.parity_step)

    def on_step_end(self, step: int) -> None:
        done = step + 1
        every = self.spec.checkpoint_every
        due = done == self.parity_step or (every and done % every == 0)
        if self.enabled and self.unsupported is None and due and done < self.spec.steps:
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
        root = Path(self.job.checkpoint_dir)
        try:
            info = ckpt.save_checkpoint(root / "final", self.strategy, self.ctx, self.job, self.signature,
                                        self.spec.steps, self.stream, self.records, export=True, base=self.base)
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
# <run_dir>/refused-checkpoints/: resume checkpoints a launch refused, kept (never deleted by distlab)
# with one line each in REFUSED.jsonl (what, where it went, why, when).
REFUSED_DIR = "refused-checkpoints"
REFUSED_LOG = "REFUSED.jsonl"


class ResumeFailed(RuntimeError):
    """A resume checkpoint that failed while loading: the launch stops; it was moved aside."""


def set_aside(path: Path, reason: str) -> Path:
    """Move a refused resume checkpoint to <run_dir>/refused-checkpoints/<name>.refused-<UTC time>
    and note why; returns where it went (where another rank already moved it, that place)."""
    folder = path.parent.parent / REFUSED_DIR
    folder.mkdir(exist_ok=True)
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = folder / f"{path.name}.refused-{when}"
    try:
        os.rename(path, kept)
    except FileNotFoundError:  # another rank of this launch moved it first
        moved = sorted(folder.glob(f"{path.name}.refused-*"))
        return moved[-1] if moved else kept
    with open(folder / REFUSED_LOG, "a") as fh:
        fh.write(json.dumps(portable({"checkpoint": str(path), "kept_as": str(kept), "reason": reason,
                                      "time": when})) + "\n")
    return kept


def refused_earlier(run_dir: Path) -> list[str]:
    """One line per refused checkpoint still kept in refused-checkpoints/ (a later launch names
    them: the launch that refused one may have been a failed job whose log is gone)."""
    log = run_dir / REFUSED_DIR / REFUSED_LOG
    lines = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        try:
            entry = json.loads(line)
            kept = run_dir / REFUSED_DIR / Path(entry["kept_as"]).name  # written relative (portable)
        except (ValueError, TypeError, KeyError):
            continue
        if kept.is_dir():
            lines.append(f"{entry['checkpoint']} was refused by an earlier launch ({entry['time']}): "
                         f"{entry['reason']}; kept as {entry['kept_as']}: delete it once you no longer need it")
    return lines


def prune_periodic(resume_root: Path, keep: int, parity_step: int | None) -> list[str]:
    """Keep the newest `keep` complete periodic checkpoints (and the parity one validation
    resumes from); remove the rest. Returns the names removed."""
    found = step_folders(resume_root)
    parity = f"step-{parity_step:06d}" if parity_step else None
    periodic = [p for p in found if p.name != parity]
    removed = periodic[:-keep] if keep > 0 else periodic
    for old in removed:
        shutil.rmtree(old)
    return [p.name for p in removed]

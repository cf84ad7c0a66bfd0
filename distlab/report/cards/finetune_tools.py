"""The fine-tuning card's training tools (stage7_finetune calls these): QLoRA beside the LoRA run
of the same spec (memory per rank, tokens/s, loss), compiled runs beside their eager twins
(speed-up, compile time, loss unchanged) and the profiler traces runs wrote, linked."""
from __future__ import annotations

import os

from distlab.report.cards import COMPARED, FAILED, NOT_RUN, PASSED, Goal, Table, metrics_link, tokens_per_s
from distlab.report.report_run import ReportRun

MIB = 2**20
# Compiled kernels reorder float sums: the compiled run's losses may move this much, no more.
COMPILE_LOSS_TOLERANCE = 1e-4
GOAL_QLORA = "QLoRA (4-bit NF4 base, LoRA adapters) measured beside LoRA"
GOAL_COMPILE = "torch.compile (regional) against the same run uncompiled, losses within 1e-4"
GOAL_PROFILE = "torch.profiler traces of chosen steps (Perfetto, TensorBoard)"


def twin(run: ReportRun, runs: list[ReportRun], **differs) -> ReportRun | None:
    """The ok run of the same machine whose spec equals `run`'s but for `differs` (and its id/tag)."""
    def key(spec, changed):
        return repr(sorted((k, repr(v)) for k, v in {**spec, **changed}.items() if k not in ("id", "tag")))

    wanted = key(run.spec, differs)
    return next((r for r in runs if r is not run and r.status == "ok" and r.machine == run.machine
                 and key(r.spec, {}) == wanted), None)


def state_mib(run: ReportRun, part: str | None = None) -> float | None:
    held = ((run.memory or {}).get("model_state_bytes_per_rank") or [None])[0]
    if not held:
        return None
    value = held.get(part, 0) if part else sum(held.get(k, 0) or 0 for k in ("params", "grads", "optimizer"))
    return round(value / MIB, 2)


def qlora_goal(card, runs: list[ReportRun]) -> None:
    qlora = [r for r in runs if r.status == "ok" and r.spec.method == "qlora"]
    if not qlora:
        card.goals.append(Goal("bonus", GOAL_QLORA, NOT_RUN, "no run set method: qlora"))
        return
    rows = []
    for run in qlora:
        lora = twin(run, runs, method="lora")
        for label, r in (("qlora", run), ("lora", lora)):
            if r is None:
                continue
            built = r.as_built.get("quantization") or {}
            rows.append({"method": label, "experiment": r.experiment,
                         "4-bit layers": built.get("linear4bit_layers", 0),
                         "weights per rank (MiB)": state_mib(r, "params"),
                         "model state per rank (MiB)": state_mib(r),
                         "tokens/s": round(tokens_per_s(r)[0], 1),
                         "loss first -> last": f"{r.loss.first:.4f} -> {r.loss.last:.4f}"})
    import pandas as pd

    paired = sum(twin(r, runs, method="lora") is not None for r in qlora)
    card.tables.append(Table("QLoRA beside LoRA", pd.DataFrame(rows),
                             "4-bit layers: bitsandbytes Linear4bit modules counted in the wrapped model (a qlora run "
                             "without one fails); weights: the parameters' bytes on rank 0 (a 4-bit weight is half a "
                             "byte); model state: weights + gradients + optimizer. The QLoRA loss is the 4-bit "
                             "model's, so it differs from LoRA's by the quantisation"))
    card.goals.append(Goal("bonus", GOAL_QLORA, PASSED if paired else COMPARED,
                           f"{len(qlora)} QLoRA run(s), {paired} beside a LoRA run of the same spec"
                           + ("" if paired else " (none has a LoRA twin to compare with)"),
                           [metrics_link(r) for r in qlora]))


def compile_goal(card, runs: list[ReportRun]) -> None:
    compiled = [r for r in runs if r.status == "ok" and r.spec.compile]
    if not compiled:
        card.goals.append(Goal("bonus", GOAL_COMPILE, NOT_RUN,
                               "no run set compile: true (compiling the layers costs about half a minute per run on "
                               "a small CPU; see the README's fine-tuning section)"))
        return
    rows, worst, paired = [], 0.0, 0
    for run in compiled:
        eager = twin(run, runs, compile=False)
        timing = run.timing.get("compile") or {}
        row = {"experiment": run.experiment, "compile (s)": round(timing.get("compile_s", 0.0), 1),
               "compiled median step (ms)": round(run.timing.step_time_s.median * 1000, 1)}
        if eager is not None:
            paired += 1
            diff = max(abs(a - b) for a, b in zip(run.loss.per_step, eager.loss.per_step))
            worst = max(worst, diff)
            row.update({"eager median step (ms)": round(eager.timing.step_time_s.median * 1000, 1),
                        "speed-up": round(eager.timing.step_time_s.median
                                          / run.timing.step_time_s.median, 2),
                        "max |loss - eager|": f"{diff:.1e}"})
        rows.append(row)
    import pandas as pd

    card.tables.append(Table("Regional compilation against eager", pd.DataFrame(rows),
                             "compile: the launch's first step minus the steady-state median (that step is untimed); "
                             "speed-up: eager median step time / compiled median step time"))
    status = (PASSED if worst <= COMPILE_LOSS_TOLERANCE else FAILED) if paired else COMPARED
    card.goals.append(Goal("bonus", GOAL_COMPILE, status,
                           f"{len(compiled)} compiled run(s), {paired} beside an eager twin; worst loss difference "
                           f"{worst:.1e} (limit {COMPILE_LOSS_TOLERANCE:g})", [metrics_link(r) for r in compiled]))


def profile_goal(card, runs: list[ReportRun]) -> None:
    profiled = [r for r in runs if r.status == "ok" and r.section("profile")]
    if not profiled:
        card.goals.append(Goal("bonus", GOAL_PROFILE, NOT_RUN, "no run set profile: {steps: [a, b]}"))
        return
    links = [os.path.join(r.folder, trace) for r in profiled for trace in r.section("profile").traces if trace]
    links += [os.path.join(r.folder, snap) for r in profiled for snap in r.section("profile").memory_snapshots if snap]
    notes = sorted({r.section("profile").memory_snapshot_note for r in profiled
                    if r.section("profile").get("memory_snapshot_note")})
    card.goals.append(Goal("bonus", GOAL_PROFILE, PASSED,
                           f"{len(profiled)} run(s) traced; open a trace in ui.perfetto.dev or TensorBoard"
                           + (f"; {'; '.join(notes)}" if notes else ""), links))

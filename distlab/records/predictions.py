"""A run's step-time prediction held to what it measured: metrics.json's `prediction` (made by
rank 0 before its first step with distlab.tools.step_time) against its measured median step, with
the tolerances a prediction must meet. Torch-free: the report, the GPU kit's summary and the tests
score recorded runs with it, without the model that made the prediction."""
from __future__ import annotations

# Within this of the measured median, a prediction counts as right (issue 44: +-25%).
TOLERANCE = 0.25
LINK_TOLERANCE = 0.30
# The terms a prediction may hold (distlab.tools.step_time.predict), in the report's column order;
# sharding only for ZeRO-3 and FSDP runs.
TERMS = ("compute", "communication", "sharding", "optimizer", "bubble")


def probe_busy(prediction: dict) -> bool:
    """Whether the compute probe the prediction read was timed while other processes used the
    cores it held (its file's `noise`, the runs' rule: distlab.tools.compute_probe): its kernels,
    and every prediction made from them, are slow by an amount nothing measured. A probe that
    recorded nothing (an older distlab, or no /proc/stat) is not held against the run."""
    return bool((prediction.get("inputs") or {}).get("probe_busy"))


def score(prediction: dict | None, measured_median: float | None, busy: bool | None,
          tolerance: float = TOLERANCE) -> dict:
    """Predicted against measured: error, verdict, and the term furthest off. A run timed on a
    busy machine, or predicted from a probe timed on one, is shown but not scored."""
    if not prediction or prediction.get("status") != "predicted":
        return {"verdict": "not predicted", "why": (prediction or {}).get("why", "no prediction")}
    if measured_median is None:
        return {"verdict": "not measured"}
    predicted = prediction["step_time_s"]
    error = predicted / measured_median - 1
    terms = {k: v["seconds"] for k, v in prediction["terms"].items()}
    # The term that would have to change most to close the gap, as a share of the step.
    largest = max(terms, key=terms.get)
    out = {"predicted_s": predicted, "measured_s": measured_median, "error": error,
           "largest_term": largest, "largest_share": terms[largest] / predicted if predicted else None}
    if busy is not False:
        return {**out, "verdict": "not scored", "why": "timed on a busy machine" if busy else "noise not measured"}
    if probe_busy(prediction):
        return {**out, "verdict": "not scored", "why": "probe timed on a busy machine"}
    return {**out, "verdict": "right" if abs(error) <= tolerance else "off"}


def check_step_times(runs: list[dict], tolerance: float | None = None) -> list[dict]:
    """Each run's predicted step time (metrics.json `prediction`, made before it trained) against
    its measured median: the error, the verdict (a busy run, or one predicted from a probe timed
    on a busy machine, is shown, not scored), and the term furthest from what the run measured
    of it: communication against the collectives' time in flight where the strategy times them,
    the rest against the remainder of the step."""
    rows = []
    for run in runs:
        if run.get("status") != "ok" or not run.get("prediction"):
            continue
        prediction = run["prediction"]
        median = run["timing"]["step_time_s"]["median"]
        scored = score(prediction, median, (run.get("noise") or {}).get("busy"),
                       tolerance or (LINK_TOLERANCE if run["spec"].link else TOLERANCE))
        row = {"experiment": run["experiment"], "verdict": scored["verdict"]}
        if prediction.get("status") != "predicted":
            rows.append({**row, "why": scored.get("why")})
            continue
        terms = {name: term["seconds"] for name, term in prediction["terms"].items()}
        comm = ((run["timing"].get("comm_inflight_s_per_step") or {}).get("median"))
        predicted_comm = prediction["terms"]["communication"].get("total_s", terms["communication"])
        measured_rest = median - (comm or 0.0)
        predicted_rest = prediction["step_time_s"] - (predicted_comm if comm is not None else 0.0)
        rest = " + ".join(name for name in TERMS if name in terms and name != "communication")
        gaps = {rest if comm is not None else "the whole step": predicted_rest - measured_rest}
        if comm is not None:
            gaps["communication"] = predicted_comm - comm
        furthest = max(gaps, key=lambda k: abs(gaps[k]))
        rows.append({**row, "predicted s": round(prediction["step_time_s"], 4), "measured s": round(median, 4),
                     "error": f"{scored['error']:+.0%}",
                     # every term a strategy can have, in one order (sharding: ZeRO-3 and FSDP only)
                     **{f"{name} s": round(terms[name], 4) if name in terms else None for name in TERMS},
                     "measured comm in flight s": None if comm is None else round(comm, 4),
                     "furthest off": f"{furthest} ({gaps[furthest]:+.3f} s)",
                     "why": scored.get("why")})
    return rows


def step_time_verdict(rows: list[dict], share: float = 0.8) -> tuple[str, str]:
    """(passed | failed | not scored, evidence): at least `share` of the scored runs right."""
    scored = [r for r in rows if r["verdict"] in ("right", "off")]
    if not scored:
        return "not scored", (f"none of {len(rows)} predicted run(s) was timed on a quiet machine" if rows
                              else "no run holds a prediction")
    right = sum(r["verdict"] == "right" for r in scored)
    return ("passed" if right >= share * len(scored) else "failed",
            f"{right} of {len(scored)} run(s) timed on a quiet machine predicted within the tolerance "
            f"({len(rows) - len(scored)} more shown, not scored)")

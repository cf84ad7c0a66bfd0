"""A run's memory peaks per phase (load, training, save) as metrics.json records them:
distlab.runtime.memory measures them inside the ranks, the summary and the report read them with these
(torch-free, so the report never imports torch for them); and how bytes are shown (the advisor's
estimates and the report's cards print them alike)."""
from __future__ import annotations


PHASES = ("load_phase", "training_phase", "save_phase")
GIB = 2**30


def unit_for(nbytes: float) -> tuple[str, float]:
    """(unit, bytes per unit) to show nbytes in: GiB from 1 GiB, else MiB."""
    return ("GiB", GIB) if nbytes >= GIB else ("MiB", 2**20)


def human(nbytes: float) -> str:
    unit, scale = unit_for(nbytes)
    return f"{nbytes / scale:.1f} {unit}"


def rank_phase_peaks(rank: dict) -> dict:
    """One rank's peak per phase (bytes, None where not recorded): CUDA reserved, else RSS."""
    out = {}
    for phase in PHASES:
        record = rank.get(phase) or {}
        value = record.get("cuda_max_reserved_bytes")
        out[phase] = value if value is not None else record.get("rss_peak_bytes")
    return out


def phase_peaks(run: dict) -> dict:
    """Largest rank's load-, training- and save-phase peaks of a run's metrics (bytes; None for
    runs recorded before the phases were measured): CUDA allocator reserved bytes, else RSS."""
    per_rank = ((run.get("memory") or {}).get("per_rank")) or []
    out = {}
    for phase in PHASES:
        records = [m.get(phase) or {} for m in per_rank]
        cuda = [r["cuda_max_reserved_bytes"] for r in records if r.get("cuda_max_reserved_bytes") is not None]
        rss = [r["rss_peak_bytes"] for r in records if r.get("rss_peak_bytes") is not None]
        out[phase] = max(cuda) if cuda else (max(rss) if rss else None)
        out[f"{phase}_what"] = "torch.cuda.max_memory_reserved" if cuda else "VmHWM (peak RSS)"
    return out

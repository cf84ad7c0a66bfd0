"""advice.json's strategy rows as every reader names them: the rows in the order the advisor
shows them and their labels (the memory estimate, distlab.tools.advisor; the time ranking, which
adds FSDP2 as a row of its own, distlab.tools.advisor_time), and the rows the report's advisor
card makes of the time ranking. Torch-free: the report reads advice.json through it."""
from __future__ import annotations

ROW_ORDER = ["ddp", "zero1", "zero2", "zero3", "zero3-offopt", "zero3-offopt-offparam"]
ROW_LABEL = {
    "ddp": "DDP (each device holds everything)",
    "zero1": "ZeRO-1 (optimizer state sharded)",
    "zero2": "ZeRO-2 (+ gradients sharded)",
    "zero3": "ZeRO-3 / FSDP full shard (+ parameters sharded)",
    "zero3-offopt": "ZeRO-3 + optimizer offload to CPU",
    "zero3-offopt-offparam": "ZeRO-3 + optimizer and parameter offload to CPU",
}
# The time ranking's rows besides those (the zero3 row stands for ZeRO-3 and FSDP full shard).
TIME_ROW_LABEL = {"fsdp": "FSDP2 full shard"}


def label(key: str) -> str:
    return TIME_ROW_LABEL.get(key) or ROW_LABEL.get(key, key)


def card_rows(time: dict) -> tuple[list[dict], list[dict]]:
    """The report's advisor card: the ranking's rows and the references' rows."""
    ranking = [{"#": i, "strategy": label(r["key"]), "predicted step s": round(r["step_time_s"], 3),
                "tokens/s per device": round(r["tokens_per_s_per_device"]),
                "compute s": round(r["terms"]["compute"]["seconds"], 3),
                "exposed comm s": round(r["terms"]["communication"]["seconds"], 3),
                "optimizer s": round(r["terms"]["optimizer"]["seconds"], 3), "largest term": r["sentence"],
                "behind the fastest by": r.get("behind", "-")}
               for i, r in enumerate(time["ranking"], 1)]
    refs = [{"model": f["model"], "hardware": f["hardware"], "strategy": f["strategy"], "metric": f["metric"],
             "published (others)": f["value"], "predicted": round(f["predicted"], 1) if "predicted" in f else None,
             "predicted/published": round(f["ratio"], 2) if "ratio" in f else None,
             "source": f"{f['by']}: {f['source']}" + (f"; {f['note']}" if f.get("note") else "")}
            for f in time["references"]]
    return ranking, refs

"""The advisor's strategy rows, in the order it shows them, and their labels: read by the memory
estimate (advisor.py) and the time ranking (advisor_time.py)."""

ROW_ORDER = ["ddp", "zero1", "zero2", "zero3", "zero3-offopt", "zero3-offopt-offparam"]
ROW_LABEL = {
    "ddp": "DDP (each device holds everything)",
    "zero1": "ZeRO-1 (optimizer state sharded)",
    "zero2": "ZeRO-2 (+ gradients sharded)",
    "zero3": "ZeRO-3 / FSDP full shard (+ parameters sharded)",
    "zero3-offopt": "ZeRO-3 + optimizer offload to CPU",
    "zero3-offopt-offparam": "ZeRO-3 + optimizer and parameter offload to CPU",
}

"""A rank that joins its process group, all-reduces once, says it is ready, and holds its
sockets open until the test releases it (tests/test_loopback.py lists them meanwhile)."""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

folder = Path(sys.argv[-1])
dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
assert tensor.item() == dist.get_world_size()
(folder / f"ready{os.environ['RANK']}").write_text(os.environ.get("MASTER_PORT", ""))
deadline = time.monotonic() + 120
while not (folder / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.destroy_process_group()

"""A rank reads its token blocks memory-mapped from the Arrow files: it holds only the rows it
indexes (as int64), not a whole int64 copy of the split; the advisor counts what it holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

LOAD = """
import json, resource, sys
from distlab.data_prep.data import load_blocks
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
blocks = load_blocks(sys.argv[1], "train")
batch = blocks[list(range(0, len(blocks), 997))]
print(json.dumps({"grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "shape": list(blocks.shape), "dtype": str(batch.dtype), "rows": len(batch),
                  "first": batch[0, :4].tolist()}))
"""


def test_a_rank_holds_the_rows_it_reads_not_an_int64_copy_of_the_split(tmp_path):
    import datasets
    import numpy as np

    n, seq = 40_000, 128  # 5.1M tokens: a whole int64 copy is 41 MB
    ids = np.arange(n * seq, dtype=np.int32).reshape(n, seq) % 50_000
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": list(ids)})}).save_to_disk(
        str(tmp_path / "data"))
    out = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "data")], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shape"] == [n, seq] and result["dtype"] == "torch.int64" and result["rows"] == 41
    assert result["first"] == ids[0, :4].tolist()
    assert result["grew_mb"] < 20, result  # well below the 41 MB an int64 copy of the split takes


def test_the_advisor_counts_the_micro_batch_a_rank_holds():
    from distlab.tools import advisor

    shape = advisor.model_shape({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                 "vocab_size": 512})
    workload = {"method": "full", "micro_batch": 4, "seq_len": 32, "precision": "fp32", "lora": None}
    for row in advisor.estimate(shape, workload, 2):
        assert row["data_bytes"] == 2 * 8 * 4 * 32
        assert row["total_bytes"] == row["model_state_bytes"] + row["activation_bytes"] + row["data_bytes"]

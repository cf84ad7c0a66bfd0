"""Data prep says how it is going: rows and tokens per second while a corpus is tokenized
(every EVERY_S seconds, per tokenizing process, into the rule's log) and a summary at the end
(also in distlab_data.json's `prep`)."""
from __future__ import annotations

import os
import time

EVERY_S = 10.0


class TokenizeProgress:
    """Wraps a batched tokenize function for Dataset.map: counts the rows and tokens it
    produced and prints them with the rate every EVERY_S seconds."""

    def __init__(self, fn, every_s: float = EVERY_S):
        self.fn, self.every_s = fn, every_s
        self.started = self.last = None
        self.rows = self.tokens = 0

    def __call__(self, batch, *args, **kwargs):
        now = time.perf_counter()
        if self.started is None:  # in the process that runs the map (a num_proc worker has its own)
            self.started = self.last = now
        out = self.fn(batch, *args, **kwargs)
        self.rows += len(next(iter(batch.values()))) if len(batch) else 0
        self.tokens += sum(len(ids) for ids in out["input_ids"])
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.tokens / (now - self.started) if now > self.started else 0.0
            print(f"data prep (pid {os.getpid()}): tokenized {self.rows:,} rows, {self.tokens:,} tokens, "
                  f"{rate:,.0f} tokens/s", flush=True)
        return out


def summary(encoded, blocks, started: float, packed_at: float) -> dict:
    """Rows, tokens and rates of the whole prep (tokens counted from the encoded Arrow table)."""
    import pyarrow.compute as pc

    tokens = int(pc.sum(pc.list_value_length(encoded.data.column("input_ids"))).as_py() or 0)
    now = time.perf_counter()
    out = {"rows": len(encoded), "tokens": tokens, "tokenize_seconds": round(packed_at - started, 3),
           "tokens_per_s": round(tokens / (packed_at - started), 1) if packed_at > started else None,
           "pack_seconds": round(now - packed_at, 3), "blocks": len(blocks),
           "how": "wall time of the tokenize map, then of the packing map; tokens = lengths of the encoded rows"}
    print(f"data prep: {out['rows']:,} rows -> {tokens:,} tokens in {out['tokenize_seconds']:.1f} s "
          f"({out['tokens_per_s'] or 0:,.0f} tokens/s), packed into {len(blocks):,} blocks in "
          f"{out['pack_seconds']:.1f} s", flush=True)
    return out

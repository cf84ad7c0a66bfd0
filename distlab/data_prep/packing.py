"""How encoded rows become fixed-length training sequences: data.packing.

blocks     one token stream cut into seq_len blocks (distlab.data_prep.data.StreamPacker): rows run
           into each other, a token attends to the rows before it in its block. Plain text's
           default: its rows are pieces of one corpus.
documents  rows packed whole into seq_len blocks, each row's position ids restarting at 0: the
           model's own mask code (transformers' create_causal_mask / create_sliding_window_causal_mask
           read packed sequences from position ids when no attention mask is given) then limits
           attention to the row, a block-diagonal causal mask. The default for chat and instruction
           rows, as TRL (position ids), LLaMA-Factory (neat_packing) and torchtitan (document masks).
none       one row per sequence, right-padded (pad labels -100): no mask needed, a causal model's
           real tokens never attend to the padding after them.

Under documents and none a row longer than seq_len is cut into pieces of seq_len tokens the same
way, and each piece is a row of its own (its first label is not trained on: nothing before it
in the piece predicts it). A piece without a trained label is dropped under both. So the two
train on the same label tokens, and their eval splits, chosen by row (not by block), hold the
same rows: the held-out loss of one model is the same under both (tests/test_packing.py).
"""
from __future__ import annotations

import bisect

from distlab.data_prep.data_formats import IGNORE

MODES = ("documents", "none", "blocks")
# Columns a packed split holds besides input_ids/labels: position ids (documents only).
POSITIONS = "position_ids"


def packed_inputs(position_ids) -> dict:
    """Forward arguments of rows packed as documents: their position ids, and no cache and no
    attention mask, the case in which the model's own mask code (transformers' create_causal_mask,
    and the sliding-window one) reads packed rows from the position ids and keeps each row's
    attention to itself."""
    return {"position_ids": position_ids, "use_cache": False}


def row_pieces(ids, labels, seq_len: int):
    """(ids, labels) pieces of one row, seq_len tokens at most, each with a trained label after
    its first token (the first label is masked: within the piece nothing predicts it)."""
    for start in range(0, len(ids), seq_len):
        piece_ids = ids[start:start + seq_len]
        piece_labels = [IGNORE] + list(labels[start + 1:start + seq_len])
        if any(label != IGNORE for label in piece_labels):
            yield list(piece_ids), piece_labels


class RowPacker:
    """Batched-map body (rows -> seq_len sequences) for packing documents or none.

    documents: best-fit decreasing over the batch's pieces (TRL's packing_strategy="bfd"), longest
    first, each into the open block it fills most, else a new one. none: one piece per sequence.
    Deterministic (a stable sort); blocks do not span batches."""

    def __init__(self, seq_len: int, mode: str, pad_id: int):
        if mode not in ("documents", "none"):
            raise ValueError(f"RowPacker packs documents or none, not {mode!r}")
        self.seq_len, self.mode, self.pad_id = seq_len, mode, pad_id
        self.position = 0

    def __call__(self, batch: dict) -> dict:
        pieces = [piece for ids, labels in zip(batch["input_ids"], batch["labels"])
                  for piece in row_pieces(ids, labels, self.seq_len)]
        blocks = [[piece] for piece in pieces] if self.mode == "none" else self._best_fit(pieces)
        out = {"input_ids": [], "labels": [], "block": [], "trained_tokens": []}
        if self.mode == "documents":
            out[POSITIONS] = []
        for block in blocks:
            self._close(block, out)
        return out

    def _best_fit(self, pieces: list) -> list[list]:
        blocks, room = [], []  # room: sorted (free tokens, block index) of the open blocks
        for index in sorted(range(len(pieces)), key=lambda i: -len(pieces[i][0])):
            length = len(pieces[index][0])
            at = bisect.bisect_left(room, (length, -1))
            if at < len(room):
                free, block = room.pop(at)
            else:
                free, block = self.seq_len, len(blocks)
                blocks.append([])
            blocks[block].append(pieces[index])
            if free - length > 0:
                bisect.insort(room, (free - length, block))
        return blocks

    def _close(self, block: list, out: dict) -> None:
        ids = [token for piece_ids, _ in block for token in piece_ids]
        labels = [label for _, piece_labels in block for label in piece_labels]
        pad = self.seq_len - len(ids)
        out["input_ids"].append(ids + [self.pad_id] * pad)
        out["labels"].append(labels + [IGNORE] * pad)
        if POSITIONS in out:  # each piece from 0; the padding a sequence of its own, attending to nothing before it
            out[POSITIONS].append([p for piece_ids, _ in block for p in range(len(piece_ids))] + list(range(pad)))
        out["block"].append(self.position)
        out["trained_tokens"].append(sum(label != IGNORE for label in labels[1:]))
        self.position += 1

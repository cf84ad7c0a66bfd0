"""Data prep through `datasets`: rows -> token ids (+ labels) -> packed fixed-length blocks.

Files load with datasets.load_dataset(<builder>, data_files=...) and every step after is a
batched Dataset.map or a generator written to Arrow as it goes: memory stays flat however
large the corpus (no Python list of it). Deterministic: files in the given order, the
embedded corpus in sorted order, one continuous token stream cut into blocks (packing blocks)
or rows packed apart (documents, none: distlab.data_prep.packing), a seeded permutation for the
train/eval split (of blocks; of rows when rows are packed apart).

Longer than ~300 lines on purpose: loading, streaming .txt pieces, tokenizing and packing are
one chain over one datasets.Dataset; each step is a function of its own here.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import time
from pathlib import Path

from distlab.configuration.data_checks import builder_for, packing_mode
from distlab.data_prep.data_formats import BUILT_CHAT_TEMPLATE, DOCUMENT_END, IGNORE, encoder_for
from distlab.data_prep.packing import POSITIONS, RowPacker
from distlab.data_prep.prep_progress import TokenizeProgress, summary
from distlab.configuration.tokenizer_checks import load_tokenizer  # noqa: F401 (data prep's, and callers' data.load_tokenizer)

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
DATA_INFO = "distlab_data.json"  # written beside the Arrow splits: tokenizer identity, token counts
BATCH = 1000  # rows per tokenize batch (one call of the fast tokenizer)
PACK_BATCH = 10_000  # encoded rows per packing batch (numpy over the whole batch)
# A plain-text file streams TEXT_READ_CHARS at a time (never a whole line: one line may be the
# whole file), cut into pieces of at least PIECE_CHARS only where tokenizing the pieces apart
# gives the document's own tokens (SAFE_CUT); with no such place within PIECE_MAX_CHARS, at the
# last line end before it, else at PIECE_MAX_CHARS.
TEXT_READ_CHARS = 4 << 20
PIECE_CHARS = 4096
PIECE_MAX_CHARS = 32 << 10


def pydoc_topics() -> list[tuple[str, str]]:
    # The pydoc topic pages: ~0.5 MB of English prose and code in every CPython install.
    import pydoc_data.topics as topics

    return [(key, topics.topics[key]) for key in sorted(topics.topics)]


def pydoc_instruction_rows(prompt_field: str = "prompt", response_field: str = "response") -> dict:
    """Instruction rows from the same local pages: a question naming the topic, answered by
    the topic's first paragraph (short, so prompt and response are comparable in size)."""
    rows = {prompt_field: [], response_field: []}
    for key, text in pydoc_topics():
        # The first paragraph of prose: not the title or its underline of asterisks.
        paragraph = next((p.strip() for p in text.split("\n\n") if len(p.strip()) > 80 and "***" not in p), None)
        if paragraph:
            rows[prompt_field].append(f"What does the Python documentation say about '{key}'?")
            rows[response_field].append(paragraph[:600])
    return rows


def load_rows(cfg: dict, cache_dir=None):
    """The dataset's rows as a datasets.Dataset (Arrow, memory-mapped for files)."""
    import datasets

    source = cfg["source"]
    if source == "python-docs":
        return datasets.Dataset.from_dict({cfg.get("text_field", "text"): [t for _, t in pydoc_topics()]})
    if source == "python-docs-instructions":
        return datasets.Dataset.from_dict(pydoc_instruction_rows(cfg["prompt_field"], cfg["response_field"]))
    if source == "files":
        parts = []
        for name in cfg["files"]:
            if builder_for(name) == "text":
                parts.append(text_file_pieces(name, cfg.get("text_field", "text"), cache_dir))
            else:
                parts.append(datasets.load_dataset(builder_for(name), data_files=[str(name)], split="train",
                                                   cache_dir=cache_dir))
        if len(parts) == 1:
            return parts[0]
        if any(DOCUMENT_END in part.column_names for part in parts):  # mixed: every row of the others ends a document
            parts = [part if DOCUMENT_END in part.column_names else
                     part.add_column(DOCUMENT_END, [True] * len(part)) for part in parts]
        return datasets.concatenate_datasets(parts)
    if source == "hf":
        return datasets.load_dataset(cfg["hf_name"], split=cfg["hf_split"], cache_dir=cache_dir)
    raise ValueError(f"data.source: unknown source {source!r}")


# Where a text may be cut into two pieces tokenized apart without changing its tokens: just
# after a line end with no whitespace on either side ("...x\ny..."). There the byte-level
# pre-tokenizers (GPT-2, Llama-3, Qwen2, GPT-NeoX) split anyway: the newline is a pre-token of
# its own or ends the one before it.
SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def piece_ends(text: str, target: int = PIECE_CHARS, max_chars: int = PIECE_MAX_CHARS) -> list[int]:
    """Cut positions for `text`: safe ones (SAFE_CUT), each piece at least `target` long;
    where no safe cut comes within max_chars, the last line end before it (else max_chars).
    What follows the last cut is left over (the start of the next piece)."""
    safe = [m.start() for m in SAFE_CUT.finditer(text)]  # one C-level scan
    ends, last, i = [], 0, 0
    while True:
        i = bisect.bisect_left(safe, last + target, i)
        if i < len(safe) and safe[i] - last <= max_chars:
            last = safe[i]
        elif len(text) - last > max_chars:
            line_end = text.rfind("\n", last + 1, last + max_chars)
            last = line_end + 1 if line_end >= 0 else last + max_chars
        else:
            return ends
        ends.append(last)


def document_pieces(path: str, field: str = "text"):
    """Rows {field: piece, DOCUMENT_END: last?} of one plain-text file, read TEXT_READ_CHARS at
    a time: memory holds one read and the text carried to the next cut, never a whole line."""
    carry = ""
    with open(path, encoding="utf-8") as fh:
        while chunk := fh.read(TEXT_READ_CHARS):
            text = carry + chunk
            ends = piece_ends(text)
            for start, end in zip([0] + ends, ends):
                yield {field: text[start:end], DOCUMENT_END: False}
            carry = text[ends[-1]:] if ends else text  # a cut always leaves text after it (piece_ends)
    if carry:
        yield {field: carry, DOCUMENT_END: True}


def text_file_pieces(name, field: str = "text", cache_dir=None):
    """A plain-text file as one document, streamed into Arrow piece by piece (datasets'
    from_generator writes as it goes); the pieces' tokens are the document's (see SAFE_CUT)."""
    import datasets

    stat = os.stat(name)  # part of the cache fingerprint: a changed file is read again
    rows = datasets.Dataset.from_generator(
        document_pieces, gen_kwargs={"path": str(name), "field": field}, cache_dir=cache_dir,
        features=datasets.Features({field: datasets.Value("string"), DOCUMENT_END: datasets.Value("bool")}),
        fingerprint=hashlib.sha256(f"{os.path.abspath(name)}|{stat.st_size}|{stat.st_mtime_ns}|{field}".encode())
        .hexdigest()[:32])
    return rows


def corpus_texts(cfg: dict) -> list[str]:
    """The text-format corpus as a list (small corpora and tests; data prep streams instead)."""
    cfg = {"text_field": "text", "format": "text", **cfg}
    return list(load_rows(cfg)[cfg["text_field"]])


def text_batches(rows, cfg: dict):
    """Batches of the rows' text for tokenizer training, read from Arrow a batch at a time
    (instruction rows: prompts and responses; chat rows: message contents)."""
    fmt = cfg.get("format", "text")
    for batch in rows.iter(batch_size=BATCH):
        if fmt == "text":
            yield batch[cfg["text_field"]]
        elif fmt == "instruction":
            yield batch[cfg["prompt_field"]] + batch[cfg["response_field"]]
        else:
            yield [m["content"] for messages in batch[cfg["messages_field"]] for m in messages]


def train_tokenizer(texts, vocab_size: int, out_dir: str | os.PathLike):
    """Byte-level BPE (the GPT-2/Llama-3 family's scheme) trained with `tokenizers`, for the
    model the pipeline builds. texts: strings, or batches (lists) of strings."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: same merges every run
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL_TOKENS[0],
                                      bos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1])
    wrapped.chat_template = BUILT_CHAT_TEMPLATE  # chat/instruction data render through it
    wrapped.save_pretrained(str(out_dir))
    return wrapped


def tokenizer_identity(tokenizer, source, saved_dir: Path) -> dict:
    """What metrics.json records: the tokenizer saved beside the data, its hash and ids."""
    tokenizer.save_pretrained(str(saved_dir))
    digest = hashlib.sha256((saved_dir / "tokenizer.json").read_bytes()).hexdigest()
    out = {"source": str(source), "tokenizer_json_sha256": digest, "saved_copy": str(saved_dir),
           "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
           "bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "class": type(tokenizer).__name__}
    source_json = Path(source) if Path(source).is_file() else Path(source) / "tokenizer.json"
    if source_json.is_file():
        out["source_tokenizer_json_sha256"] = hashlib.sha256(source_json.read_bytes()).hexdigest()
    return out


class StreamPacker:
    """Batched-map body over Arrow batches: one continuous token stream cut into seq_len
    blocks (tail dropped), the remainder of each batch carried into the next (so it runs in
    one process, in order). numpy over the whole batch's flattened token buffer: no Python
    work per row or per token. Masked formats drop blocks without a single trained label
    after the causal shift: such a block teaches nothing and its loss would be 0/0."""

    def __init__(self, seq_len: int, with_labels: bool):
        import numpy as np

        self.seq_len, self.with_labels = seq_len, with_labels
        self.columns = ["input_ids", "labels"] if with_labels else ["input_ids"]
        self.carry = {c: np.zeros(0, dtype=np.int32) for c in self.columns}
        self.position = 0

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        seq = self.seq_len
        streams = {}
        for c in self.columns:
            flat = pc.list_flatten(batch.column(c)).to_numpy()  # the batch's token buffer, no row loop
            streams[c] = np.concatenate([self.carry[c], flat.astype(np.int32, copy=False)])
        n = len(streams["input_ids"]) // seq
        cut = {c: streams[c][:n * seq].reshape(n, seq) for c in self.columns}
        for c in self.columns:
            self.carry[c] = streams[c][n * seq:].copy()
        positions = np.arange(self.position, self.position + n, dtype=np.int64)
        self.position += n
        if self.with_labels:
            trained = (cut["labels"][:, 1:] != IGNORE).sum(axis=1).astype(np.int32)
        else:
            trained = np.full(n, seq - 1, dtype=np.int32)
        keep = trained > 0
        kept = int(keep.sum())
        offsets = pa.array(np.arange(0, (kept + 1) * seq, seq, dtype=np.int32))
        out = {c: pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(cut[c][keep]).ravel()))
               for c in self.columns}
        out["block"], out["trained_tokens"] = pa.array(positions[keep]), pa.array(trained[keep])
        return pa.table(out)


def build_dataset(rows, tokenizer, seq_len: int, eval_fraction: float, seed: int, out_dir, cfg: dict | None = None,
                  num_proc: int = 1, cache_dir=None, tokenizer_source=None):
    """Encode (batched map, num_proc workers), pack (one sequential batched map over Arrow
    batches), split, save_to_disk. rows: a datasets.Dataset, or a list of texts (text format).
    Returns the DatasetDict."""
    import tempfile

    import datasets
    import numpy as np

    datasets.disable_progress_bars()  # the job log gets the summary, not bars
    cfg = {"format": "text", "text_field": "text", **(cfg or {})}
    if isinstance(rows, list):
        rows = datasets.Dataset.from_dict({cfg["text_field"]: rows})
    fn, fn_kwargs, columns = encoder_for(cfg, tokenizer)
    with_labels = cfg["format"] != "text"
    packing = packing_mode(cfg)
    if packing != "blocks" and not with_labels:
        raise ValueError(f"data.packing {packing} packs chat or instruction rows; text is packed as blocks")
    ids = datasets.Sequence(datasets.Value("int32"))
    encoded_features = datasets.Features({"input_ids": ids, **({"labels": ids} if with_labels else {})})
    features = datasets.Features({**encoded_features, **({POSITIONS: ids} if packing == "documents" else {}),
                                  "block": datasets.Value("int64"), "trained_tokens": datasets.Value("int32")})
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        # new_fingerprint: the results live in a scratch folder removed below, so nothing is
        # looked up by fingerprint; naming one skips hashing the tokenizer (dill) per map.
        tag = f"{rows._fingerprint}-{seq_len}-{cfg['format']}"
        workers = num_proc if num_proc > 1 and len(rows) >= 2 * num_proc else None
        if cfg["format"] == "text" and getattr(tokenizer, "is_fast", False):
            # One process: the fast tokenizer's batch encoding spreads over the job's threads
            # itself (Rust, one shared BPE cache). num_proc workers each pickle the tokenizer
            # and warm their own cache: measured here, ~40% more CPU for the same ids.
            os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, num_proc)))
            workers = None
        started = time.perf_counter()
        encoded = rows.map(TokenizeProgress(fn), fn_kwargs=fn_kwargs, batched=True, batch_size=BATCH,
                           remove_columns=rows.column_names, num_proc=workers,
                           features=encoded_features, new_fingerprint=f"{tag}-tokenize",
                           cache_file_name=os.path.join(scratch, "encoded.arrow"), desc="tokenize")
        packed_at = time.perf_counter()
        pack = dict(batched=True, batch_size=PACK_BATCH, remove_columns=encoded.column_names, features=features)
        if packing == "blocks":
            blocks = encoded.with_format("arrow").map(
                StreamPacker(seq_len, with_labels), **pack, new_fingerprint=f"{tag}-pack",
                cache_file_name=os.path.join(scratch, "packed.arrow"), desc="pack").with_format(None)
            parts = split_blocks(blocks, eval_fraction, seed)
        else:
            # Split by row before packing: the held-out rows are whole (distlab.data_prep.packing).
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            order = np.random.default_rng(seed).permutation(len(encoded))
            n_eval = max(1, int(round(len(encoded) * eval_fraction)))
            parts = {name: encoded.select(np.sort(rows)).map(
                RowPacker(seq_len, packing, pad), **pack, new_fingerprint=f"{tag}-{packing}-{name}",
                cache_file_name=os.path.join(scratch, f"packed-{name}.arrow"), desc=f"pack {name}")
                for name, rows in (("eval", order[:n_eval]), ("train", order[n_eval:]))}
            blocks = datasets.concatenate_datasets([parts["train"], parts["eval"]])
            if not len(parts["train"]) or not len(parts["eval"]):
                raise ValueError(f"{len(encoded)} rows give {len(parts['train'])} train and {len(parts['eval'])} "
                                 "eval sequences: too few rows for this eval_fraction")
        prep = summary(encoded, blocks, started, packed_at)
        if len(blocks) < 4:
            raise ValueError(f"only {len(blocks)} blocks of {seq_len} tokens: the corpus is too small for this seq_len")
        datasets.DatasetDict(parts).save_to_disk(str(out_dir))
    saved = datasets.load_from_disk(str(out_dir))
    info = {"format": cfg["format"], "packing": packing, "seq_len": seq_len, "rows": len(rows), "blocks": len(blocks),
            "eval_blocks": cfg.get("eval_blocks", 16), "prep": prep,  # eval_blocks: the held-out tokens
            "splits": {name: token_counts(part, seq_len) for name, part in saved.items()}}
    if tokenizer_source is not None:
        info["tokenizer"] = tokenizer_identity(tokenizer, tokenizer_source, Path(out_dir) / "tokenizer")
    Path(out_dir, DATA_INFO).write_text(json.dumps(info, indent=1))
    return saved


def split_blocks(blocks, eval_fraction: float, seed: int) -> dict:
    """packing blocks: a seeded permutation of the blocks, its first eval_fraction held out."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(blocks))
    n_eval = max(1, int(round(len(blocks) * eval_fraction)))
    return {"eval": blocks.select(order[:n_eval]), "train": blocks.select(np.sort(order[n_eval:]))}


def column(split, name: str):
    """One column as a numpy array, read in one go (not row by row), honouring a select()."""
    return split.select_columns([name]).with_format("numpy")[:][name]


def token_counts(split, seq_len: int) -> dict:
    """Label positions the loss counts (after the causal shift) vs masked (-100)."""
    trained = int(column(split, "trained_tokens").sum())
    total = len(split) * (seq_len - 1)
    return {"blocks": len(split), "trained_tokens": trained, "masked_tokens": total - trained}


def read_data_info(path) -> dict:
    file = Path(path) / DATA_INFO
    return json.loads(file.read_text()) if file.is_file() else {}


class TokenBlocks:
    """One column of a split's blocks, [n_blocks, seq_len], read memory-mapped from the Arrow
    files (a zero-copy numpy view per Arrow chunk): a rank holds only the rows it indexes, as
    an int64 tensor; the split itself stays in the page cache the OS shares between ranks."""

    def __init__(self, part, column: str):
        import numpy as np
        import pyarrow.compute as pc

        if getattr(part, "_indices", None) is not None:
            raise ValueError("a prepared split must be saved flat (save_to_disk), not as an index mapping")
        self.views, starts, seq = [], [0], None
        for chunk in part.data.column(column).chunks:
            if len(chunk) == 0:
                continue
            lengths = pc.list_value_length(chunk)
            low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
            if low != high or (seq is not None and low != seq):
                raise ValueError(f"column {column!r} holds blocks of {low} to {high} tokens; all must be equal")
            seq = low
            values = chunk.flatten().to_numpy(zero_copy_only=True)  # a view onto the mapped file
            self.views.append(values.reshape(len(chunk), seq))
            starts.append(starts[-1] + len(chunk))
        self.starts = np.asarray(starts)
        self.shape = (int(self.starts[-1]), seq or 0)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        import numpy as np
        import torch

        if isinstance(index, (int, np.integer)):  # one block, as a tensor's [i] gives it
            return self[[index]][0]
        if isinstance(index, tuple):  # [rows, columns...]: the rows read, the rest applied to them
            return self[index[0]][(slice(None), *index[1:])]
        if isinstance(index, slice):
            index = range(*index.indices(len(self)))
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"block index out of range (0..{len(self) - 1})")
        rows = rows % max(len(self), 1)
        chunk = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty((len(rows), self.shape[1]), dtype=np.int64)
        for c in np.unique(chunk):
            mine = chunk == c
            out[mine] = self.views[c][rows[mine] - self.starts[c]]
        return torch.from_numpy(out)


def load_blocks(path, split: str = "train", column: str = "input_ids") -> TokenBlocks:
    """One split's blocks [n_blocks, seq_len], memory-mapped (indexing gives int64 tensors)."""
    import datasets

    return TokenBlocks(datasets.load_from_disk(str(path))[split], column)


def load_positions(path, split: str = "train"):
    """The split's position ids (packing documents: restarting per row), or None where a
    sequence's positions are 0..seq_len-1 (the model's own default)."""
    import datasets

    part = datasets.load_from_disk(str(path))[split]
    return TokenBlocks(part, POSITIONS) if POSITIONS in part.column_names else None


def load_labels(path, split: str = "train"):
    """The split's labels (-100 = not trained on), or None where every token is a label."""
    import datasets

    part = datasets.load_from_disk(str(path))[split]
    return TokenBlocks(part, "labels") if "labels" in part.column_names else None


def run_data_facts(data_dir, records_by_rank: list[list[dict]], ranks_per_replica: int = 1) -> dict:
    """For metrics.json: the prepared data's tokenizer identity and format, and the label
    positions this run's micro-batches trained on vs masked (from the blocks each rank read;
    ranks_per_replica: TP/PP ranks read the same blocks as one model replica)."""
    import datasets

    info = read_data_info(data_dir)
    train = datasets.load_from_disk(str(data_dir))["train"]
    seq_len = len(train[0]["input_ids"])
    per_block = column(train, "trained_tokens")
    read = [i for recs in records_by_rank for rec in recs for i in rec["samples"]]
    trained = int(per_block[read].sum()) // ranks_per_replica
    total = len(read) * (seq_len - 1) // ranks_per_replica
    return {"format": info.get("format", "text"), "packing": info.get("packing", "blocks"),
            "tokenizer": info.get("tokenizer"),
            "prepared": info.get("splits"),
            "run_tokens": {"trained": trained, "masked": total - trained,
                           "how": "label positions after the causal shift (seq_len - 1 per block) over every "
                                  "block every rank read; masked = label -100 (prompt/user tokens)"}}

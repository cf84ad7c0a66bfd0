"""Rows -> token ids and labels, one function per data.format (batched Dataset.map bodies).

text: every token is a label. chat and instruction: the conversation is rendered with the
tokenizer's own chat template and only the assistant/response tokens are labels; the rest
are -100, which Hugging Face's loss (and the pipeline stage's cross_entropy) ignore - the
convention of TRL's SFTTrainer, LLaMA-Factory and axolotl.
"""
from __future__ import annotations

import functools

from distlab.configuration.tokenizer_checks import pieces_split_cleanly

IGNORE = -100
# Instruction rows with a tokenizer that has no chat template (documented in schema.yaml).
PLAIN_PROMPT = "### Instruction:\n{prompt}\n\n### Response:\n"
# The chat template the pipeline gives the tokenizer it trains for the built model.
BUILT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Rows that are pieces of a longer document (a plain-text file streamed in pieces) carry this
# column: EOS follows only the piece that ends its document. Rows without it are documents.
DOCUMENT_END = "document_end"


# Texts cut after a line end, as a streamed .txt file is cut into pieces.
@functools.lru_cache(maxsize=8)  # once per tokenizer, not once per batch of rows
def pieces_tokenize_like_the_whole(tokenizer) -> bool:
    return pieces_split_cleanly(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_text(batch: dict, tokenizer, field: str) -> dict:
    """Documents, each followed by EOS (the separator packing keeps). One batched call of the
    fast tokenizer per batch; no attention masks (packing needs none)."""
    eos = tokenizer.eos_token_id
    ends = batch.get(DOCUMENT_END)
    if ends is not None and not pieces_tokenize_like_the_whole(tokenizer):
        # Tokenized apart, each streamed piece would gain a leading space marker: other ids
        # than the document's. Refused rather than trained on silently changed text.
        raise ValueError(f"a plain-text file streams in pieces, and this tokenizer "
                         f"({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')}) tokenizes "
                         "pieces differently from the whole text (it prepends a space marker to every "
                         "call); give the data as JSON lines, one document per row, instead of .txt")
    ids = tokenizer(batch[field], add_special_tokens=False, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]
    for index, row in enumerate(ids):
        if ends is None or ends[index]:
            row.append(eos)
    return {"input_ids": ids}


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant turn.

    A turn's span runs from the end of the conversation before it rendered with the
    generation prompt to the end of the conversation through it: the template's own
    closing tokens (end-of-turn, EOS) are trained on, as the model must learn to stop."""
    full = _render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], add_generation_prompt=True) if index else ""
        through = _render(tokenizer, messages[:index + 1])
        if not (full.startswith(before) and full.startswith(through)):
            raise ValueError("the chat template does not render conversations prefix by prefix; "
                             "cannot tell the assistant tokens apart")
        spans.append((len(before), len(through)))
    return full, spans


def _labels_in_spans(encoded, spans) -> list[int]:
    labels = []
    for token_id, (start, _end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        inside = any(lo <= start < hi for lo, hi in spans)
        labels.append(token_id if inside else IGNORE)
    return labels


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = list(encoded["input_ids"]), _labels_in_spans(encoded, spans)
    if not text.rstrip().endswith(tokenizer.eos_token):  # the separator packing needs, once
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    return ids, labels


def encode_chat(batch: dict, tokenizer, field: str) -> dict:
    out = {"input_ids": [], "labels": []}
    for messages in batch[field]:
        ids, labels = encode_conversation(tokenizer, messages)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def encode_instruction(batch: dict, tokenizer, prompt_field: str, response_field: str) -> dict:
    out = {"input_ids": [], "labels": []}
    for prompt, response in zip(batch[prompt_field], batch[response_field]):
        if tokenizer.chat_template:
            ids, labels = encode_conversation(tokenizer, [{"role": "user", "content": prompt},
                                                          {"role": "assistant", "content": response}])
        else:
            head = tokenizer(PLAIN_PROMPT.format(prompt=prompt), add_special_tokens=False)["input_ids"]
            tail = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, labels = head + tail, [IGNORE] * len(head) + tail
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def encoder_for(cfg: dict, tokenizer):
    """(function, fn_kwargs, source columns) for Dataset.map of this dataset's format."""
    fmt = cfg["format"]
    if fmt == "text":
        return encode_text, {"tokenizer": tokenizer, "field": cfg["text_field"]}, [cfg["text_field"]]
    if fmt == "chat":
        if not tokenizer.chat_template:
            raise ValueError("data.format chat needs a tokenizer with a chat template")
        return encode_chat, {"tokenizer": tokenizer, "field": cfg["messages_field"]}, [cfg["messages_field"]]
    fields = [cfg["prompt_field"], cfg["response_field"]]
    return encode_instruction, {"tokenizer": tokenizer, "prompt_field": fields[0], "response_field": fields[1]}, fields

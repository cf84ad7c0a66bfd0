"""Runs in the data prep rules (scripts/prepare_data.py, once per corpus, before any training job):
rows read through `datasets`, turned into token ids and labels (one function per data.format),
packed into fixed-length blocks, with rows and tokens per second in the rule's log. The checks
of the same files at config time are distlab.configuration's (data_checks, tokenizer_checks).
"""

"""The tiny-workspace harness that tests and benchmarks share (as numpy.testing or
torch.testing): the tiny model's config, a prepared workspace (tokenizer, data, model,
hardware.json) built with the pipeline's own code, one experiment's resolved spec, and one
experiment run through the real launcher. No pytest here: tests/conftest.py wraps these in
fixtures, and benchmarks import them directly."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from distlab.records.spec import Spec

# Small enough that a 2-rank run costs a few seconds of process start, not of training.
TINY_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "max_position_embeddings": 128, "tie_word_embeddings": False, "seed": 0}
TINY_DATA = {"source": "python-docs", "vocab_size": 512, "eval_fraction": 0.05, "seed": 0}
TINY_DEFAULTS = {"steps": 6, "untimed_steps": 2, "seq_len": 32, "micro_batch": 4, "device": "cpu"}


def tiny_config(stages: dict, **top) -> dict:
    """A config dict for the tiny model: `stages` as in config.yaml."""
    cfg = {"data": dict(TINY_DATA), "model": {"build": dict(TINY_MODEL)}, "defaults": dict(TINY_DEFAULTS),
           "stages": copy.deepcopy(stages)}
    cfg.update(top)
    return cfg


def build_prepared(root: Path) -> Path:
    """The tiny workspace in `root`: tokenizer + data (seq 32) + tiny model + hardware.json."""
    root.mkdir(parents=True, exist_ok=True)
    from distlab.data_prep import data
    from distlab.configuration import hardware
    from distlab.runtime import model
    from distlab.configuration.config import validate_schema

    cfg = validate_schema(tiny_config({}))
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tokenizer")
    data.build_dataset(texts, tok, 32, 0.05, 0, root / "data32")
    model.build_base_model(cfg["model"]["build"], tok, root / "model")
    info = hardware.describe("testbox", probe=False)
    info["cpu_peak"] = {"per_thread": hardware.measure_cpu_matmul_peak(1, size=256, seconds=0.2)}
    (root / "hardware.json").write_text(json.dumps(info))
    return root


def resolve(overrides: dict, stage: str = "ddp", **defaults) -> dict:
    """The resolved spec of one experiment of the tiny config."""
    from distlab.configuration.config import load

    cfg = tiny_config({stage: {"experiments": [overrides]}})
    cfg["defaults"].update(defaults)
    _, specs = load(cfg, gpu_count=0)
    (spec,) = specs.values()
    return spec


def workflow_data_dirs(cfg: dict, prep: Path) -> set[Path]:
    """Where the workflow reads the prepared data of `cfg`'s experiments (and rule prepare_data
    writes it) under its `prep` folder: each experiment's task's data_dir, which rules/common.smk asks."""
    from distlab.configuration.config import load
    from distlab.configuration.tasks.declaration import declaration_for

    _, specs = load(copy.deepcopy(cfg), gpu_count=0)
    return {Path(declaration_for(spec).data_dir(spec, str(prep))) for spec in specs.values()}


def build_instruction_data(prepared: Path, out_dir: Path, seq_len: int = 32, **options) -> Path:
    """config.yaml's pydoc-instructions dataset (instruction rows, prompt labels -100) prepared
    with the tiny workspace's tokenizer; options: further data keys (packing, eval_blocks)."""
    from distlab.data_prep import data

    cfg = {"source": "python-docs-instructions", "format": "instruction", "prompt_field": "prompt",
           "response_field": "response", **options}
    tok = data.load_tokenizer(prepared / "tokenizer")
    data.build_dataset(data.load_rows(cfg), tok, seq_len, 0.1, 0, out_dir, cfg=cfg,
                       tokenizer_source=prepared / "tokenizer")
    return out_dir


def run_experiment(prepared: Path, run_dir: Path, spec: Spec, checkpoint: bool = True, data_dir=None) -> dict:
    """Run one experiment through distlab.jobs.launch (real ranks) on the workspace's data (or
    data_dir's); returns its metrics (as the one reader, run_outputs.read_run_record, reads them)."""
    from distlab.records.job import Job
    from distlab.jobs.launch import launch
    from distlab.records.run_outputs import read_run_record

    data_dir = data_dir or prepared / f"data{spec.seq_len}"
    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(data_dir),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=["OMP_NUM_THREADS"],
              checkpoint_dir=str(run_dir / "checkpoint") if checkpoint else None)
    launch(job, log_path=str(run_dir / "train.log"), timeout=300)
    return read_run_record(run_dir / "metrics.json").to_dict()  # its spec typed, as the report's cards get it

"""Stage 3's minimal goal for real in the default run: config/config.yaml holds a ZeRO-0
1-rank run and a ZeRO-3 2-rank run of one model.extra model under one per-rank budget, and
the card's budget goal reads passed only when both verdicts were enforced. Planning only:
the config, the card on recorded runs and a Snakemake dry run; nothing trains."""
from __future__ import annotations

from card_runs import changed, fake_run
from conftest import REPO, snakemake

MIB = 2**20


def llama_parameters(shape: dict, vocab: int) -> int:
    """Parameters of the built Llama (untied embeddings unless tie_word_embeddings)."""
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return vocab * h * (1 if shape.get("tie_word_embeddings") else 2) + layers * per_layer + h


def default_pair():
    from distlab.configuration.config import load_file

    config, specs = load_file(REPO / "config" / "config.yaml", gpu_count=0)
    budgeted = [s for s in specs.values() if s["stage"] == "deepspeed" and s["memory_budget_gib"]]
    (one,) = [s for s in budgeted if s["world_size"] == 1 and s["deepspeed"]["zero_stage"] == 0]
    (three,) = [s for s in budgeted if s["world_size"] >= 2 and s["deepspeed"]["zero_stage"] == 3]
    return config, specs, one, three


def test_the_default_config_holds_the_budget_pair_on_its_own_built_model():
    from distlab.configuration.config import model_shape
    from distlab.configuration.validation_scope import validated_experiments
    from distlab.report.cards.zero_memory import zero_formula_bytes

    config, specs, one, three = default_pair()
    assert one["memory_budget_gib"] == three["memory_budget_gib"]
    assert one["model"] == three["model"] and one["model"] in config["model"]["extra"]
    assert one["method"] == three["method"] == "full" and one["precision"] == three["precision"]
    assert (one["micro_batch"], one["seq_len"]) == (three["micro_batch"], three["seq_len"])  # same work per rank
    assert max(one["steps"], three["steps"]) <= 5  # a few steps: the pair shows memory, not speed
    # Only the pair runs on that model; every other run keeps the base model.
    assert {s["id"] for s in specs.values() if s.get("model", "default") != "default"} == {one["id"], three["id"]}
    # Big enough that sharding saves more than a second DeepSpeed process costs (~0.1 GiB).
    psi = llama_parameters(model_shape(config, one), config["data"]["vocab_size"])
    saved = zero_formula_bytes(psi, 1, 0, "fp32") - zero_formula_bytes(psi, three["world_size"], 3, "fp32")
    assert psi > 30e6 and saved > 200 * MIB
    # A run that may end oom is no format's checkpoint-validation representative.
    assert not {one["id"], three["id"]} & set(validated_experiments(config, specs))


def _verdict(fits: bool, enforced: bool, measured_mib: float, budget_gib: float) -> dict:
    return {"fits": fits, "enforced": enforced, "bytes": int(budget_gib * 2**30), "measured_bytes": measured_mib * MIB,
            "measured_what": "peak RSS of the whole rank process", "how": "RSS watchdog in the rank process (test)"}


def _pair(tmp_path, one_status: str, one_enforced: bool, three_enforced: bool, three_model: str | None = None):
    """The default pair's specs as recorded runs: ZeRO-0 at 1 rank (oom, or ok over budget) and
    ZeRO-3 at 2 ranks (ok within it)."""
    _, _, one_spec, three_spec = default_pair()
    gib = one_spec["memory_budget_gib"]
    over = {"strategy": "deepspeed", "memory_budget_gib": gib, "micro_batch": 1}
    one = fake_run(tmp_path / "one", {**over, "world_size": 1, "deepspeed": {"zero_stage": 0}}, "deepspeed",
                   budget=_verdict(False, one_enforced, gib * 1024 * 1.2, gib), status=one_status)
    three = fake_run(tmp_path / "three", {**over, "world_size": 2, "deepspeed": {"zero_stage": 3}}, "deepspeed",
                     budget=_verdict(True, three_enforced, gib * 1024 * 0.8, gib))
    oom = {"oom": [{"rank": 0, "error_type": "MemoryError", "error": "passed the memory budget"}]} \
        if one_status == "oom" else {}
    one = changed(one, spec=one.spec.replace(model=one_spec["model"]), **oom)
    three = changed(three, spec=three.spec.replace(model=three_model or three_spec["model"]))
    return [one, three]


def test_the_budget_goal_passes_only_when_both_verdicts_were_enforced(tmp_path):
    from distlab.report.cards import COMPARED, FAILED, PASSED
    from distlab.report.cards.stage3_deepspeed import budget_goal

    enforced = budget_goal(_pair(tmp_path, "oom", True, True))
    assert enforced.status == PASSED and "status oom" in enforced.evidence and "enforced budget" in enforced.evidence
    # The 1-rank run finished over a budget only compared after it: not shown to be held to it.
    assert budget_goal(_pair(tmp_path, "ok", False, True)).status == COMPARED
    assert budget_goal(_pair(tmp_path, "oom", True, False)).status == COMPARED
    # A pair on two different models shows nothing about sharding.
    assert budget_goal(_pair(tmp_path, "oom", True, True, three_model="default")).status == FAILED


def test_the_pair_plans_its_own_model_eval_and_no_checkpoint_validation(tmp_path):
    """Dry run of the default config: the pair's jobs build the model.extra model once and
    evaluate it as their base model; no validation job is planned for them."""
    import shutil

    _, _, one, three = default_pair()
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    targets = [f"results/plan/{s['id']}/metrics.json" for s in (one, three)]
    proc = snakemake(tmp_path, "-n", "--cores", "2", "--config", "machine=plan", "--", *targets,
                     timeout=300)
    out = proc.stdout
    name = one["model"]
    assert out.count(f"output: results/prep/model_{name}/config.json") == 1
    assert f"results/prep/eval/base-default-seq{one['seq_len']}_{name}.json" in out
    assert f"results/prep/model_{name}/config.json, results/plan/hardware.json" in out  # train inputs
    assert "validate_checkpoint" not in out


def test_the_advisor_check_leaves_runs_on_a_model_extra_model_out(tmp_path):
    """The advice sizes the base model: its estimate is never set against another model's run."""
    from distlab.tools import advisor_check

    _, _, one, three = default_pair()
    runs = _pair(tmp_path, "oom", True, True)
    assert runs[1].spec.model == three["model"] != "default"
    assert advisor_check.check_against_runs({"model": {"shape": {}}}, [run.metrics for run in runs]) == []

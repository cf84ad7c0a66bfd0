"""The formulas behind the printed figures; metrics.json's one writer and one reader."""
import ast

import pytest
import torch

from distlab.records import metrics as M


def _tiny_causal_lm(tied: bool, kv_heads: int, lora: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import TINY_MODEL
    from distlab.runtime.lora import apply_lora

    torch.manual_seed(0)
    shape = {k: v for k, v in TINY_MODEL.items() if k not in ("seed", "tie_word_embeddings", "num_key_value_heads")}
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=512, tie_word_embeddings=tied,
                                                         num_key_value_heads=kv_heads, **shape))
    if lora:
        model, _ = apply_lora(model, {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}, 0)
    return model


@pytest.mark.parametrize("tied,kv_heads,lora", [(True, 4, False), (False, 4, False), (False, 4, True),
                                                 (True, 4, True), (False, 2, False)],
                         ids=["tied", "untied", "lora", "tied-lora", "gqa"])
def test_flops_formula_agrees_with_an_independent_flop_count(tied, kv_heads, lora):
    model = _tiny_causal_lm(tied, kv_heads, lora)
    flops = M.model_flops_per_token(model, 32)
    assert flops["counted_per_token"] is not None, flops["how"]
    assert abs(flops["counted_over_formula"] - 1) <= 0.10, flops
    assert flops["mfu_uses"] == "counted" and flops["flops_per_token"] == flops["counted_per_token"]
    # the count is a side trip: no gradient is left behind for the first optimizer step
    assert all(p.grad is None for p in model.parameters())


def test_a_tied_embedding_is_billed_as_the_lm_head_and_frozen_weights_skip_the_weight_gradient():
    untied, tied = _tiny_causal_lm(False, 4, False), _tiny_causal_lm(True, 4, False)
    # same matmuls: the tied weight is the head's, only the untied input lookup is left out
    assert M.formula_flops_per_token(tied, 32)["formula_per_token"] == \
        M.formula_flops_per_token(untied, 32)["formula_per_token"]
    full, lora = M.formula_flops_per_token(untied, 32), M.formula_flops_per_token(_tiny_causal_lm(False, 4, True), 32)
    attention = 12 * 2 * 4 * 16 * 32  # 12*L*H*Dh*S: no weights, the same in both
    assert lora["formula_per_token"] - attention < 0.85 * (full["formula_per_token"] - attention)  # ~4N vs 6N
    # (not 4/6: these r=8 adapters add a quarter of the tiny layers' weights, all trained)


def test_mfu_is_achieved_over_peak_and_empty_without_a_peak():
    assert M.mfu(100.0, 10.0, 2000.0) == 0.5
    assert M.mfu(100.0, 10.0, None) is None


def test_summarize_gives_median_and_spread():
    s = M.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0 and s["n"] == 4
    assert s["p25"] <= s["median"] <= s["p75"]


def test_state_bytes_count_params_grads_and_adam_state():
    model = torch.nn.Linear(10, 10)  # 110 fp32 params
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    state = M.model_state_bytes(model, opt)
    assert state["params"] == 110 * 4 and state["grads"] == 110 * 4
    # exp_avg + exp_avg_sq per param (8 bytes) + a scalar step tensor per parameter tensor
    assert 110 * 8 <= state["optimizer"] <= 110 * 8 + 2 * 8


def test_tied_or_viewed_tensors_are_counted_once():
    base = torch.zeros(100)
    assert M.tensor_bytes([base, base[:50], base.view(10, 10)]) == 400


def test_only_allow_listed_environment_lands_in_results(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert M.allowed_environment(["OMP_NUM_THREADS"]) == {"OMP_NUM_THREADS": "1"}


def test_a_machine_without_an_nvidia_driver_has_no_gpus_but_a_broken_driver_is_an_error(monkeypatch):
    import pynvml
    import pytest

    from distlab.configuration import hardware

    monkeypatch.delenv("DISTLAB_GPU_COUNT", raising=False)

    def missing():
        raise pynvml.NVMLError_LibraryNotFound()

    def broken():
        raise pynvml.NVMLError_Unknown()

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    assert hardware.gpu_count() == 0
    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    with pytest.raises(RuntimeError, match="NVML"):
        hardware.gpu_count()


def test_a_metrics_write_that_fails_halfway_leaves_the_previous_record_whole(tmp_path, monkeypatch):
    """metrics.json is written beside and renamed over (run_outputs.write_metrics, its one
    writer): a full disk or a kill mid-write never leaves half a file where a record was."""
    import json
    from pathlib import Path

    from distlab.records.run_outputs import write_outputs

    write_outputs(str(tmp_path), ({"status": "ok", "loss": 1.5}, []))
    real_write = Path.write_text

    def half_then_full_disk(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(OSError):
        write_outputs(str(tmp_path), ({"status": "oom", "loss": float("nan")}, []))
    monkeypatch.undo()
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"status": "ok", "loss": 1.5}


def test_metrics_json_reads_back_through_its_one_reader_as_written_and_read_only(tmp_path):
    """run_outputs.read_run_record, the one reader: what write_metrics wrote comes back with
    its typed fields and the whole file read-only; another schema version or a missing field is
    refused with the file and the field named."""
    import json
    import re

    from distlab.records.metrics import METRICS_SCHEMA_VERSION
    from distlab.records.run_outputs import ResultsError, read_run_record, write_metrics

    written = {"schema_version": METRICS_SCHEMA_VERSION, "experiment": "ddp-x", "machine": "box", "stage": "ddp",
               "status": "ok", "spec": {"world_size": 2}, "loss": {"per_step": [3.0, float("nan")]}}
    write_metrics(tmp_path, written)
    record = read_run_record(tmp_path / "metrics.json")
    assert (record.experiment, record.machine, record.stage, record.status) == ("ddp-x", "box", "ddp", "ok")
    assert record.spec["world_size"] == 2 and record.data["loss"]["per_step"] == [3.0, None]
    with pytest.raises(TypeError):
        record.data["spec"]["world_size"] = 1
    copy = record.to_dict()
    copy["loss"]["per_step"][0] = 1.0  # a fresh, mutable copy; the record stays as read
    copy["spec"] = copy["spec"].replace(world_size=1)  # its spec typed and frozen: changed by replace
    assert record.spec.world_size == 2 and copy["loss"]["per_step"] == [1.0, None]
    assert record.data["loss"]["per_step"] == [3.0, None]
    path = tmp_path / "metrics.json"
    for change, words in (({"schema_version": 99}, "metrics schema_version 99"),
                          ({"stage": None}, "field 'stage'"), ({"spec": [1]}, "field 'spec': not an object")):
        path.write_text(json.dumps({**written, **change}))
        with pytest.raises(ResultsError, match=re.escape(f"{path}: {words}")):
            read_run_record(path)


# Hand reads of metrics.json that stay, each for a reason of its own: the file's bytes as the
# writer left them (a record without the fields the reader requires), a copied results folder
# retagged in place as another machine would have written it, and records damaged on purpose
# to show the report refuses them.
HAND_READS_KEPT = {("tests/test_metrics.py",
                    "test_a_metrics_write_that_fails_halfway_leaves_the_previous_record_whole"),
                   ("tests/test_merge.py", "fake_second_machine"),
                   ("tests/test_merge.py", "test_untrustworthy_results_from_other_machines_are_named_and_left_out"),
                   ("tests/test_opt_in_pages.py",
                    "test_a_page_given_a_run_of_its_stage_that_does_not_read_fails_naming_it"),
                   # json.loads of a summary.csv cell (strategy_settings), in a function that also names
                   # the run's metrics.json path for the summary to read
                   ("tests/test_strategy_settings.py", "test_a_new_strategy_runs_through_the_summary_and_the_report")}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def metrics_json_hand_reads(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each json.load / json.loads of metrics.json in `source`:
    the name spelled inside the call, or a name bound to an expression that spells it (an
    assignment, a for loop or comprehension over a glob, a `with open(...)`), in the function or
    a scope around it, through any chain of such names."""
    def spells_it(node, bound: set[str]) -> bool:
        return any((isinstance(n, ast.Constant) and isinstance(n.value, str) and "metrics.json" in n.value)
                   or (isinstance(n, ast.Name) and n.id in bound) for n in ast.walk(node))

    def own_nodes(scope):  # the scope's nodes, not those of the functions inside it
        stack = list(ast.iter_child_nodes(scope))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, SCOPES):
                stack.extend(ast.iter_child_nodes(node))

    def bindings(node):  # (value, target) pairs a node binds
        if isinstance(node, ast.Assign):
            return [(node.value, t) for t in node.targets]
        if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            return [(node.value, node.target)]
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            return [(node.iter, node.target)]
        if isinstance(node, ast.withitem) and node.optional_vars is not None:
            return [(node.context_expr, node.optional_vars)]
        return []

    found = []

    def visit(scope, name: str, inherited: set[str]) -> None:
        nodes = list(own_nodes(scope))
        pairs = [pair for node in nodes for pair in bindings(node)]
        bound, grew = set(inherited), True
        while grew:
            more = {n.id for value, target in pairs if spells_it(value, bound)
                    for n in ast.walk(target) if isinstance(n, ast.Name)}
            grew, bound = not more <= bound, bound | more
        for node in nodes:
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("load", "loads")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"
                    and any(spells_it(arg, bound) for arg in node.args)):
                found.append((node.lineno, name))
            elif isinstance(node, SCOPES):
                visit(node, getattr(node, "name", name), bound)

    visit(ast.parse(source), "<module>", set())
    return sorted(found)


def test_no_module_reads_metrics_json_by_hand_tests_and_benchmarks_included():
    """run_outputs.read_run_record is the one reader of metrics.json: the package, its scripts,
    the test modules and the benchmarks read a run's record through it (schema version checked,
    the file read-only), none with json.load of its own."""
    from conftest import REPO

    hand = [f"{path.relative_to(REPO)}:{line} ({function})"
            for folder in ("distlab", "scripts", "tests", "benchmarks")
            for path in sorted((REPO / folder).rglob("*.py"))
            for line, function in metrics_json_hand_reads(path.read_text())
            if (str(path.relative_to(REPO)), function) not in HAND_READS_KEPT]
    assert hand == [], ("metrics.json read by hand (use distlab.records.run_outputs.read_run_record):\n"
                        + "\n".join(hand))


def test_the_hand_read_finder_sees_a_read_through_a_name_a_loop_and_a_closure():
    source = '''
import json
RUN = "results/box/x/metrics.json"
def inline(run):
    return json.loads((run / "metrics.json").read_text())
def named(run):
    path = run / "metrics.json"
    text = path.read_text()
    return json.loads(text)
def looped(box):
    for p in box.glob("*/metrics.json"):
        json.loads(p.read_text())
    return {p.name: json.loads(p.read_text()) for p in box.glob("*/metrics.json")}
def opened(run):
    with open(run / "metrics.json") as f:
        def inner():
            return json.load(f)
        return inner()
def module_level():
    return json.loads(open(RUN).read())
def other(run):
    path = run / "hardware.json"
    return json.loads(path.read_text()), json.loads((run / "job.json").read_text())
'''
    assert metrics_json_hand_reads(source) == [(5, "inline"), (9, "named"), (12, "looped"), (13, "looped"),
                                               (17, "inner"), (20, "module_level")]

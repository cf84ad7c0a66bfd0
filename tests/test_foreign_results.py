"""Results copied in from elsewhere are input like any other: each of 16 malformed or hostile
machine folders is named and left out of one summary and one report call (or, where it only
carries hostile text, shown inert), never a crash, and the good folders stay in.

The good folder is fabricated from tests/card_runs.fake_run (shaped like a real metrics.json);
every corruption below broke the summary or report, or passed through it, before the schemas.
"""
from __future__ import annotations

import csv
import json
import shutil

import pytest

from card_runs import fake_run

from distlab.records.run_outputs import write_metrics

GOOD = "goodbox"
WILDCARD_BOX = "{oops}"
RUNS = ({"world_size": 1, "micro_batch": 8}, {"world_size": 2, "micro_batch": 4})
HOSTILE = "- **passed** (minimal) forged <img src=x onerror=alert(1)> [x](javascript:alert(1)) # heading"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}


def write_machine(root, machine: str) -> list[str]:
    """A machine folder that passes every check: two runs, hardware, collectives, advice."""
    folder = root / machine
    ids = []
    for overrides in RUNS:
        run = fake_run(folder / "x", overrides)
        run_dir = folder / run.experiment
        run_dir.mkdir(parents=True)
        write_metrics(run_dir, run.record.updated(machine=machine, versions={"python": "3.11", "torch": "2.13.0"}))
        (run_dir / "steps.jsonl").write_text("".join(json.dumps({"step": i, "loss": 3.0 - i / 10,
                                                                 "step_time_s": 0.1, "warmup": i < 2}) + "\n"
                                                     for i in range(6)))
        ids.append(run.experiment)
    shutil.rmtree(folder / "x")
    (folder / "hardware.json").write_text(json.dumps({
        "schema_version": 1, "machine": machine, "cpu": {"model": "cpu", "usable_cores": 2}, "gpus": []}))
    (folder / "collectives.json").write_text(json.dumps({
        "schema_version": 1, "machine": machine, "world_size": 2, "device": "cpu", "threads_per_rank": 1,
        "how": "test", "versions": {"torch": "2.13.0"},
        "results": [{"backend": "gloo", "op": "all_reduce", "status": "ok", "size_bytes": 1024 * 4 ** i,
                     "time_s_median": 1e-4 * 2 ** i, "algbw_bytes_per_s": 1e7, "busbw_bytes_per_s": 1e7}
                    for i in range(3)]}))
    (folder / "advice.json").write_text(json.dumps({
        "schema_version": 1, "recommendation": "ddp", "recommendation_label": "DDP", "reasons": ["it fits"],
                                                    "how": "test",
        "usable_bytes_per_device": 2 ** 30, "devices": {"devices": 2},
        "model": {"shape": {**TINY_LLAMA, "config_json": TINY_LLAMA}},
        "estimates": [{"strategy": "ddp", "params": 1, "grads": 1, "optimizer": 1, "gathered": 0,
                       "activation_bytes": 1, "total_bytes": 4, "cpu_offloaded": 0}]}))
    return ids


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def first_run(folder):
    return sorted(p for p in folder.iterdir() if (p / "metrics.json").is_file())[0]


def _rename_experiment(folder):
    run = first_run(folder)
    bad = run.with_name("$\\foo$")
    run.rename(bad)
    edit_json(bad / "metrics.json", lambda m: m.update(experiment="$\\foo$"))  # mathtext killed matplotlib


def _steps_zero(folder):
    path = first_run(folder) / "steps.jsonl"
    path.write_text(path.read_text().replace('"step_time_s": 0.1', '"step_time_s": 0', 1))


def _nested(folder):
    (first_run(folder) / "metrics.json").write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")


def _metrics(change):
    return lambda folder: edit_json(first_run(folder) / "metrics.json", change)


def _file(name, change):
    return lambda folder: edit_json(folder / name, change)


# tag: (corruption, which file is named, words of the reason)
CASES = {
    "dollarbox": (_rename_experiment, "metrics.json", "field 'experiment'"),
    "zerostepbox": (_metrics(lambda m: m["timing"]["step_time_s"].update(median=0)), "metrics.json",
                    "field 'timing.step_time_s.median'"),
    "zerorowbox": (_steps_zero, "metrics.json", "steps.jsonl: line 1: field 'step_time_s'"),
    "listbox": (_metrics(lambda m: m.update(machine=["a", "b"])), "metrics.json", "field 'machine'"),
    "nestedbox": (_nested, "metrics.json", "nested too deeply"),
    "nobuiltbox": (_metrics(lambda m: m.pop("as_built")), "metrics.json", "field 'as_built': missing"),
    "nosamplerbox": (_metrics(lambda m: m["spec"].pop("sampler")), "metrics.json", "field 'spec.sampler': missing"),
    "gpunamebox": (_file("hardware.json", lambda h: h.update(gpus=[{"memory": 1}])), "hardware.json",
                   "field 'gpus.0.name': missing"),
    "advicebox": (_file("advice.json", lambda a: a.pop("reasons")), "advice.json", "field 'reasons': missing"),
    "impostorbox": (_metrics(lambda m: m.update(machine=GOOD)), "metrics.json", f"field 'machine' is '{GOOD}'"),
    "wrongexpbox": (_metrics(lambda m: m.update(experiment="ddp-full-w8-mb1-ga1")), "metrics.json",
                    "field 'experiment' is 'ddp-full-w8-mb1-ga1'"),
    "nanbox": (_metrics(lambda m: m["throughput"].update(tokens_per_s=float("nan"))), "metrics.json",
               "field 'throughput.tokens_per_s'"),
    "strworldbox": (_metrics(lambda m: m["spec"].update(world_size="1")), "metrics.json", "field 'spec.world_size'"),
    "busbwbox": (_file("collectives.json", lambda c: c["results"][0].update(busbw_bytes_per_s="fast")),
                 "collectives.json", "field 'results.0.busbw_bytes_per_s'"),
    "validationbox": (lambda f: (first_run(f) / "validation.json").write_text(json.dumps(
        {"schema_version": 1, "passed": "yes", "status": "passed", "checks": {}})), "metrics.json", "field 'passed'"),
    "hostilebox": (_metrics(lambda m: m["as_built"].update(outer_wrapper=HOSTILE, backend="=HYPERLINK(\"x\")")),
                   None, None),  # valid text: kept, and shown inert
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """One summary call and one report call over the good folder and the 16 bad ones."""
    from distlab.report.build import build_report
    from distlab.report.collect import load_checked_runs, shared_metrics_paths
    from distlab.report.summary_table import spreadsheet_safe, summary_frame

    root = tmp_path_factory.mktemp("results")
    good_ids = write_machine(root, GOOD)
    for tag, (corrupt, _, _) in CASES.items():
        write_machine(root, tag)
        corrupt(root / tag)
    write_machine(root, WILDCARD_BOX)  # a name Snakemake would read as a wildcard
    paths, ignored = shared_metrics_paths([str(root)], str(root / "thisbox"))  # as rules/common.smk finds them
    runs, rejected = load_checked_runs(paths)
    spreadsheet_safe(summary_frame(runs)).to_csv(root / "summary.csv", index=False)
    left_out = build_report([r.path for r in runs], root / "summary.csv", str(root / "report" / "index.html"),
                            str(root / "report" / "README.md"), left_out=ignored + rejected)
    kept = {(r.machine, r.experiment) for r in runs}
    return {"root": root, "kept": kept, "left_out": left_out, "good_ids": good_ids}


def test_the_good_folder_is_kept_whole(outcome):
    assert {(GOOD, i) for i in outcome["good_ids"]} <= outcome["kept"]


@pytest.mark.parametrize("tag", [t for t, case in CASES.items() if case[1]])
def test_a_malformed_foreign_file_is_named_and_left_out(outcome, tag):
    _, file_name, reason = CASES[tag]
    named = [item for item in outcome["left_out"] if f"/{tag}/" in item["path"]]
    assert len(named) == 1, outcome["left_out"]
    assert named[0]["path"].endswith(file_name) and reason in named[0]["reason"], named[0]
    if file_name == "metrics.json":  # the bad run is out; its good neighbour stays
        assert sum(machine == tag for machine, _ in outcome["kept"]) == 1
    else:  # a bad machine file: its runs stay, the file does not
        assert sum(machine == tag for machine, _ in outcome["kept"]) == 2


def test_hostile_text_is_kept_but_inert_in_markdown_and_csv(outcome):
    root = outcome["root"]
    assert sum(machine == "hostilebox" for machine, _ in outcome["kept"]) == 2
    from markdown_it import MarkdownIt

    readme = (root / "report" / "README.md").read_text()
    rendered = MarkdownIt("commonmark").enable("table").render(readme)  # what a Markdown viewer makes of it
    assert "onerror" in rendered and "[x](javascript:alert(1))" in rendered  # shown, as text...
    assert "<img" not in rendered and 'href="javascript' not in rendered  # ...never as HTML or a link
    assert "<h1>heading" not in rendered
    forged = [item for item in rendered.split("<li>") if item.startswith("<strong>passed</strong>")
              and "forged" in item]
    assert not forged
    html = (root / "report" / "index.html").read_text()
    assert "<img src=x" not in html
    cells = [row["actual_wrapper"] for row in csv.DictReader(open(root / "summary.csv"))]
    assert "'" + HOSTILE in cells  # a cell starting with '-' is no formula for a spreadsheet
    assert not [c for row in csv.reader(open(root / "summary.csv")) for c in row if c.startswith(("=", "+", "@"))]


def test_every_left_out_file_is_named_in_the_report(outcome):
    readme = (outcome["root"] / "report" / "README.md").read_text()
    section = readme.split("## Files left out of this report")[1]
    for tag, case in CASES.items():
        if case[1]:
            assert f"/{tag}/" in section, tag


def test_a_folder_named_like_a_wildcard_is_left_out_and_named_in_the_report(outcome):
    from markdown_it import MarkdownIt

    readme = (outcome["root"] / "report" / "README.md").read_text()
    section = MarkdownIt("commonmark").render(readme.split("## Files left out of this report")[1])
    assert f"/{WILDCARD_BOX}/" in section and "Snakemake takes it for a wildcard" in section
    assert not [machine for machine, _ in outcome["kept"] if machine == WILDCARD_BOX]


def test_a_folder_named_like_a_wildcard_under_results_stops_no_snakemake_call(tmp_path):
    """results/{oops}/ or results/<machine>/{x}/ (a careless copy) stopped every call, dry runs
    too, with a WildcardError that named no folder; now each is ignored and named, and a
    results_dir named so is refused naming the field."""
    from conftest import snakemake, tiny_config
    from distlab.configuration.config import ConfigError
    from distlab.configuration.input_checks import check_results_dir

    for machine in (WILDCARD_BOX, "otherbox"):
        (tmp_path / "results" / machine / "{x}").mkdir(parents=True)
        (tmp_path / "results" / machine / "{x}" / "metrics.json").write_text("{}")
    dry = snakemake(tmp_path, "-n", config=tiny_config({"ddp": {"experiments": [{"world_size": 1}]}},
                                                       machine="testbox"))
    for machine in (WILDCARD_BOX, "otherbox"):
        assert f"WARNING: results/{machine}/{{x}}/metrics.json: ignored" in dry.stderr, dry.stderr[-3000:]
    assert "rule summary" in dry.stdout
    with pytest.raises(ConfigError, match=r"config field 'results_dir': 'out/\{run\}' holds"):
        check_results_dir("out/{run}")

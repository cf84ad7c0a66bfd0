"""The opt-in pages (`snakemake links`, `snakemake unequal`) show every run of their own stage,
built from run files that real launches wrote; a page given a run of its stage that does not
read fails (its rule with it) naming the file, rather than writing a page without it."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import resolve, run_experiment
from distlab.launchers import links

SHORT = {"steps": 2, "untimed_steps": 1}


@pytest.fixture(scope="module")
def stage_runs(prepared, tmp_path_factory):
    """Tiny real runs filed as the workflow files them (results/<machine>/<experiment>/), each
    launched with its stage's spec: links, a 1-rank run and (where namespaces can be made) a
    2-rank run over a capped link; unequal, a 2-rank run of uniform micro-batches."""
    results = tmp_path_factory.mktemp("results")
    machine = json.loads((prepared / "hardware.json").read_text())["machine"]
    specs = {"links": [resolve({"world_size": 1}, stage="links", **SHORT)],
             "unequal": [resolve({"world_size": 2, "rank_cpu_threads": [1, 1]}, stage="unequal", **SHORT)]}
    if not links.refusal():
        specs["links"].append(resolve({"world_size": 2, "link": {"bandwidth_mbit": 1000}}, stage="links", **SHORT))
    paths = {}
    for stage, stage_specs in specs.items():
        for spec in stage_specs:
            run_dir = results / machine / spec["id"]
            metrics = run_experiment(prepared, run_dir, spec, checkpoint=False)
            assert metrics["stage"] == stage and metrics["status"] == "ok"
            paths.setdefault(stage, []).append(str(run_dir / "metrics.json"))
    return results, paths


def page_of(stage: str, metrics_paths: list[str], out) -> str:
    from distlab.report.pages import links_page, unequal_page

    files = [str(out / "index.html"), str(out / "README.md"), str(out / "card.json")]
    if stage == "links":
        links_page(metrics_paths, [], *files)
    else:
        unequal_page(metrics_paths, *files)
    return (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["links", "unequal"])
def test_a_stage_page_shows_every_run_its_real_launches_wrote(stage, stage_runs, tmp_path):
    _, paths = stage_runs
    readme = page_of(stage, paths[stage], tmp_path / stage)
    assert f"{len(paths[stage])} run(s)" in readme
    for path in paths[stage]:
        experiment = json.loads(open(path).read())["experiment"]
        assert experiment in readme, experiment


@pytest.mark.slow
def test_a_page_given_a_run_of_its_stage_that_does_not_read_fails_naming_it(stage_runs, tmp_path):
    from distlab.report.pages import PageLeavesOutItsRuns

    _, paths = stage_runs
    good = paths["unequal"][0]
    run_dir = tmp_path / "results" / "box" / Path(good).parent.name  # the same run, filed under another machine
    shutil.copytree(Path(good).parent, run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["machine"] = "box"
    metrics["throughput"].pop("tokens_per_s")
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    with pytest.raises(PageLeavesOutItsRuns, match=re.escape(str(run_dir / "metrics.json")) + ".*field 'throughput'"):
        page_of("unequal", [good, str(run_dir / "metrics.json")], tmp_path / "page")
    assert not (tmp_path / "page" / "README.md").exists()


"""The compute probe a run's step-time prediction reads: each kernel of its key timed in a
process of its own (distlab.launchers.call), which on CPU forks from the run's warm interpreter as
ranks do."""
from __future__ import annotations

import json

import pytest

from distlab.launchers import warm_start
from distlab.testing import TINY_MODEL
from distlab.tools.compute_probe import run_probe
from distlab.runtime.parameter_counts import model_shape, parameter_counts
from distlab.tools.step_time import kernels_needed

from warm_fixtures import server  # noqa: F401 - a fixture

KEY = "cpu-float32-t1-r2x32-tp1"


def tiny_config_json(tmp_path):
    config = {"model_type": "llama", "vocab_size": 512, "rms_norm_eps": 1e-6,
              **{k: v for k, v in TINY_MODEL.items() if k != "seed"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return config, path


@pytest.mark.slow
def test_the_probe_times_every_kernel_of_its_key_and_starts_warm_where_a_server_is_offered(server, tmp_path,
                                                                                         monkeypatch):
    config, path = tiny_config_json(tmp_path)
    shape = model_shape(config)
    wanted = {f"{k['key']}|{k['dtype']}|{k['threads']}" for k in kernels_needed(KEY, shape, parameter_counts(shape))}

    run_probe(str(path), KEY, "tiny", str(tmp_path / "fresh.json"))
    monkeypatch.setenv(warm_start.SOCKET_ENV, server)
    run_probe(str(path), KEY, "tiny", str(tmp_path / "warm.json"))

    fresh, warm = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("fresh", "warm"))
    for record in (fresh, warm):
        assert record["key"] == KEY and set(record["kernels"]) == wanted
        assert all(row["s"] > 0 and row["repeats"] >= 3 for row in record["kernels"].values())
    assert fresh["start"] == "fresh interpreter"
    assert warm["start"].startswith("forked from the run's warm interpreter"), warm["start"]


def test_a_call_names_a_distlab_function_before_any_process_starts(tmp_path):
    from distlab.launchers.call import call_in_own_process

    for target in ("os:system", "distlab.tools.compute_probe", "distlab.tools.compute_probe:not a name"):
        with pytest.raises(ValueError, match="distlab.<module>:<function>"):
            call_in_own_process(target, str(tmp_path / "out.json"))

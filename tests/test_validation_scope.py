"""The default validation covers every checkpoint format the run writes, one job per format."""
from __future__ import annotations

import yaml

from conftest import REPO
from distlab.records.spec import Spec


def test_default_validation_covers_each_zero_stage_offload_and_fsdp_variant_once():
    from distlab.configuration.config import load
    from distlab.configuration.validation_scope import checkpoint_format, validated_experiments

    cfg, specs = load(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), gpu_count=0)
    chosen = validated_experiments(cfg, specs)
    # A task's checkpoint (the causal LM's or the SD UNet's) is a format of its own.
    formats = {(s.get("task"), s["strategy"], s["method"], s["launcher"], s["fsdp"]["via"] if s["strategy"] == "fsdp"
                else None, checkpoint_format(s)) for s in specs.values()}
    assert len(chosen) == len(formats)  # one job per distinct format, none left out
    zero = {(specs[i]["deepspeed"]["zero_stage"], specs[i]["deepspeed"]["offload_param"]) for i in chosen
            if specs[i]["strategy"] == "deepspeed"}
    assert zero == {(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "cpu")}
    fsdp = {(specs[i]["fsdp"]["reshard_after_forward"], specs[i]["fsdp"]["cpu_offload"]) for i in chosen
            if specs[i]["strategy"] == "fsdp"}
    assert fsdp == {(True, False), (False, False), (True, True)}
    assert {specs[i]["strategy"] for i in chosen} >= {"ddp", "accelerate", "deepspeed", "fsdp", "tp", "pp"}
    assert any(specs[i]["launcher"] == "ray" for i in chosen)
    assert any(specs[i]["method"] == "lora" for i in chosen)


def test_while_rank_0_checks_the_export_the_other_ranks_import_the_model_code():
    """A validation launch's ranks do not wait idle through rank 0's export check and only
    then import transformers' modeling code one after another: they import it meanwhile."""
    from types import SimpleNamespace

    from distlab.records.job import ValidationJob
    from distlab.rank.validate_ranks import check_export_meanwhile_import

    def run(rank: int, plan: list) -> list:
        calls = []
        task = SimpleNamespace(check_export=lambda v: calls.append(("export", v.rank)),
                               import_code=lambda source, lora: calls.append(("import", source, lora)))
        validator = SimpleNamespace(rank=rank, task=task, spec=Spec({"method": "lora"}),
                                    guarded=lambda name, check: (calls.append(name), check()))
        check_export_meanwhile_import(validator, ValidationJob(spec={}, run_dir="run", plan=plan, model_source="base"))
        return calls

    assert run(0, [["same", 2], ["reshard", 1]]) == ["export", ("export", 0)]
    assert run(1, [["same", 2], ["reshard", 1]]) == [("import", "base", True)]
    assert run(0, [["reshard", 2]]) == [("import", "base", True)]  # no export check in this launch

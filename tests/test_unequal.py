"""Unequal devices: per-rank micro-batches give the uniform gradient and beat uniform batches
when the ranks are not equally fast (distlab/runtime/unequal.py)."""
import json
import os
import textwrap

import pytest

from conftest import REPO, resolve, run_experiment

# Two gloo ranks take their slices [6, 2] of one global batch of 8, through the real
# DDPStrategy (loss weighting) and IndexStream (slicing); rank 0 then computes the 1-rank
# gradient of the same 8 samples on a plain model. Labels are masked unevenly (sample i loses
# its first 3*(i % 5) tokens), so a weighting by samples instead of label tokens would show.
GRADIENT_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from distlab.data_prep.data import load_blocks
    from distlab.runtime.accumulation import step_items
    from distlab.rank.loop import IndexStream
    from distlab.records.spec import Spec
    from distlab.runtime.model import load_model
    from distlab.strategies.base import RunContext
    from distlab.tasks import task_for
    from distlab.strategies.ddp import DDPStrategy

    prepared, out, spec = sys.argv[1], sys.argv[2], Spec(json.loads(sys.argv[3]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = load_blocks(prepared + "/data32", "train")[:]  # the whole split, as a tensor
    labels = blocks.clone()
    for i in range(len(labels)):
        labels[i, : 3 * (i % 5)] = -100

    def flat_grad(params):
        return torch.cat([p.grad.flatten() for p in params])

    strategy = DDPStrategy(RunContext(spec=spec, run_dir=out, device=torch.device("cpu"), rank=rank, world_size=world,
                                      task=task_for(spec)))
    strategy.wrap(load_model(prepared + "/model"))
    stream = IndexStream(len(blocks), spec, rank, world, strategy.rank_batches)
    mine = stream.next()
    batch = {"input_ids": blocks[mine], "labels": labels[mine]}
    strategy.forward_backward(batch, 0, 1, step_items(strategy, [batch], torch.device("cpu")))
    sized = flat_grad(strategy.model.module.parameters())
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        uniform_spec = spec.replace(micro_batch=sum(strategy.rank_batches), rank_micro_batch=None)
        whole = IndexStream(len(blocks), uniform_spec, 0, 1).next()
        model = load_model(prepared + "/model")
        model(input_ids=blocks[whole], labels=labels[whole]).loss.backward()
        uniform = flat_grad(model.parameters())
        json.dump({"max_abs_diff": (sized - uniform).abs().max().item(), "uniform_max": uniform.abs().max().item(),
                   "slices": everyone, "whole": whole}, open(out + "/gradient.json", "w"))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_sized_micro_batches_give_the_one_rank_gradient_of_the_same_samples(prepared, tmp_path):
    from distlab.launchers.process import run_ranks
    from distlab.launchers.torchrun import torchrun_command

    (tmp_path / "gradient_check.py").write_text(GRADIENT_SCRIPT)
    spec = resolve({"world_size": 2, "micro_batch": 4, "rank_micro_batch": [6, 2]})
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    run_ranks(torchrun_command(2, "gradient_check", str(prepared), str(tmp_path), json.dumps(spec)), env,
              str(tmp_path / "launch.log"), timeout=300)
    result = json.loads((tmp_path / "gradient.json").read_text())
    first, second = result["slices"]
    assert len(first) == 6 and len(second) == 2 and first + second == result["whole"]  # the same 8 samples
    assert result["uniform_max"] > 1e-3  # a real gradient, not zeros
    assert result["max_abs_diff"] < 1e-6, result["max_abs_diff"]


def test_sized_batches_split_by_speed_within_memory():
    from distlab.runtime.unequal import split_batch

    assert split_batch(8, [2.0, 1.0], [None, None]) == [5, 3]  # largest remainders
    assert split_batch(8, [1.0, 1.0], [None, None]) == [4, 4]
    assert split_batch(8, [10.0, 1.0], [3, None]) == [3, 5]  # the fast rank's memory holds 3
    assert split_batch(8, [100.0, 1.0], [None, None]) == [7, 1]  # every rank keeps at least one
    with pytest.raises(ValueError, match="memory holds"):
        split_batch(8, [1.0, 1.0], [3, 3])


# Unequal CPU devices: rank 1 may use a quarter of rank 0's CPU time (cgroup CFS quota).
BUDGETS = {"world_size": 2, "micro_batch": 12, "rank_cpu_budget": [0.5, 0.125], "steps": 14, "untimed_steps": 3}


@pytest.fixture(scope="module")
def uniform_and_sized(prepared, tmp_path_factory):
    from distlab.configuration.cpu_budget import refusal

    if refusal():
        pytest.skip(f"CPU budgets cannot be enforced here: {refusal()}")
    root = tmp_path_factory.mktemp("unequal")
    uniform = run_experiment(prepared, root / "uniform", resolve(BUDGETS), checkpoint=False)
    sized = run_experiment(prepared, root / "sized", resolve(dict(BUDGETS, rank_micro_batch="auto")), checkpoint=False)
    return uniform, sized


@pytest.mark.slow
def test_sized_batches_give_the_slower_rank_fewer_samples_and_read_each_sample_once(uniform_and_sized):
    # Which of the two is faster is a measurement, not a promise a test can keep on a busy
    # machine: the unequal page shows it (tokens/s and each rank's wait in the all-reduce).
    uniform, sized = uniform_and_sized
    assert [b["cores"] for b in sized["as_built"]["cpu_budget"]] == [0.5, 0.125]  # what the kernel enforced
    fast, slow = sized["as_built"]["rank_micro_batch"]["sizes"]
    assert fast + slow == 24 and slow < fast  # auto measured rank 1 slower and gave it less
    assert sized["data"]["per_rank_reads"] == [fast * 14, slow * 14] and sized["data"]["duplicate_reads"] == 0
    reads = uniform["data"]["per_rank_reads"]  # uniform: each rank the same share
    assert reads[0] == reads[1] == sum(sized["data"]["per_rank_reads"]) // 2 and uniform["data"]["duplicate_reads"] == 0


@pytest.mark.parametrize("experiment, field, why", [
    ({"world_size": 2, "micro_batch": 4, "rank_micro_batch": [6, 1]}, "rank_micro_batch",
     "sum to 7, but micro_batch x world_size = 8"),
    ({"world_size": 2, "micro_batch": 4, "rank_micro_batch": [8]}, "rank_micro_batch", "1 entries for world_size 2"),
    ({"strategy": "fsdp", "world_size": 2, "micro_batch": 4, "rank_micro_batch": [6, 2]}, "rank_micro_batch",
     "a DDP feature"),
    ({"world_size": 2, "rank_cpu_threads": [2]}, "rank_cpu_threads", "one thread count per rank"),
    ({"world_size": 2, "rank_cpu_budget": [0.5, 0.25, 0.1]}, "rank_cpu_budget", "one budget per rank"),
])
def test_unequal_device_settings_that_cannot_hold_are_refused_naming_the_field(experiment, field, why):
    from distlab.configuration.input_checks import ConfigError

    with pytest.raises(ConfigError, match=rf"\.{field}': .*{why}"):
        resolve(experiment)


def test_each_rank_gets_its_own_thread_count():
    from distlab.runtime.unequal import rank_threads

    spec = resolve({"world_size": 2, "rank_cpu_threads": [2, 1]})
    assert [rank_threads(spec, rank) for rank in (0, 1)] == [2, 1]
    assert rank_threads(resolve({"world_size": 2}), 1) == resolve({"world_size": 2})["cpu_threads_per_rank"]

"""Stage 1 promises: DDP over gloo with real ranks."""
import pytest

from conftest import resolve, run_experiment


@pytest.mark.slow
def test_two_rank_ddp_matches_one_rank_loss_at_the_same_global_batch(prepared, tmp_path):
    one = run_experiment(prepared, tmp_path / "w1", resolve({"world_size": 1, "micro_batch": 8}), checkpoint=False)
    two = run_experiment(prepared, tmp_path / "w2", resolve({"world_size": 2, "micro_batch": 4}), checkpoint=False)
    assert two["actual"]["world_size"] == 2 and two["actual"]["outer_wrapper"] == "DistributedDataParallel"
    assert len(one["loss"]["per_step"]) == len(two["loss"]["per_step"]) == 6
    for a, b in zip(one["loss"]["per_step"], two["loss"]["per_step"]):
        assert abs(a - b) < 1e-4, (one["loss"]["per_step"], two["loss"]["per_step"])
    # The loss moved: the parity above is between two real trajectories, not two constants.
    assert one["loss"]["per_step"][-1] < one["loss"]["per_step"][0]

"""Why DistributedSampler: disjoint shards that cover the epoch, and what happens without it."""
from distlab.rank.loop import IndexStream
from distlab.rank.run_summary import coverage
from distlab.records.spec import Spec


def _spec(sampler, micro_batch=4):
    return Spec({"sampler": sampler, "seed": 7, "micro_batch": micro_batch})


def _run(sampler, world, steps, n=101):
    streams = [IndexStream(n, _spec(sampler), rank, world) for rank in range(world)]
    records = [[{"samples": s.next()} for _ in range(steps)] for s in streams]
    plans = [s.epoch_plan() for s in streams]
    return coverage(records, plans, n)


def test_distributed_sampler_shards_are_disjoint_and_cover_the_epoch():
    cov = _run("distributed", world=2, steps=5)
    assert cov["duplicate_reads"] == 0 and cov["epoch_plan_disjoint"]
    assert cov["epoch_plan_covered"] == 100 and cov["epoch_plan_dropped"] == 1  # 101 -> equal shards of 50
    assert cov["per_rank_reads"] == [20, 20]


def test_without_the_sampler_every_rank_reads_the_same_samples():
    cov = _run("none", world=2, steps=5)
    assert cov["duplicate_fraction"] == 0.5 and cov["samples_read_by_every_rank"] == 20
    assert not cov["epoch_plan_disjoint"]


def test_two_ranks_read_exactly_the_one_rank_global_batch():
    one = IndexStream(64, _spec("distributed", micro_batch=8), 0, 1)
    ranks = [IndexStream(64, _spec("distributed", micro_batch=4), r, 2) for r in range(2)]
    for _ in range(4):
        assert sorted(one.next()) == sorted(ranks[0].next() + ranks[1].next())


def test_stream_moves_to_a_new_shuffled_epoch_when_one_ends():
    stream = IndexStream(8, _spec("distributed", micro_batch=4), 0, 1)
    first = stream.next() + stream.next()
    second = stream.next() + stream.next()
    assert sorted(first) == sorted(second) == list(range(8)) and first != second and stream.epoch == 1

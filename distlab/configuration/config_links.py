"""Config rules of the roadmap's hardware lessons (rules/links.smk targets): links between
namespaced ranks (link, stages' link_caps_mbit) and unequal devices (rank_micro_batch,
rank_cpu_threads, rank_cpu_budget). Light like distlab.configuration.config: the Snakefile imports it."""
from __future__ import annotations

import math

from distlab.records.spec import SpecFields


def link_label(mbit: float | None) -> str:
    """100 -> '100m', 1000 -> '1g', 2500 -> '2.5g', None -> 'free' (namespaced, uncapped)."""
    if mbit is None:
        return "free"
    return f"{mbit / 1000:g}g" if mbit >= 1000 else f"{mbit:g}m"


def with_link_caps(block: dict, base: dict) -> list[tuple[int, dict]]:
    """(index in the config, override) of a stage's experiments: each 2+-rank one without a
    link of its own once per `link_caps_mbit` entry (in that order), when the stage sets it."""
    caps = block.get("link_caps_mbit")
    out = []
    for index, override in enumerate(block.get("experiments", [])):
        if caps and "link" not in override and override.get("world_size", base["world_size"]) > 1:
            out += [(index, dict(override, link={"bandwidth_mbit": cap})) for cap in caps]
        else:
            out.append((index, override))
    return out


def check_unequal_and_link(spec: SpecFields, fail) -> None:
    """Per-rank batches and threads (unequal devices), and links between namespaced ranks."""
    world = spec.world_size
    sized, threads, budget = spec.rank_micro_batch, spec.rank_cpu_threads, spec.rank_cpu_budget
    if (sized, threads, budget) != (None, None, None) and spec.launcher != "torchrun":
        fail("launcher", "per-rank batches, threads and CPU budgets are set by distlab's torchrun ranks; use "
             "launcher torchrun")
    if sized is not None:
        if spec.strategy != "ddp":
            fail("rank_micro_batch", f"per-rank micro-batches are a DDP feature (each rank's loss weighted by its "
                 f"share of the batch); {spec.strategy} splits batches its own way")
        if spec.sampler != "distributed":
            fail("rank_micro_batch", "per-rank micro-batches split one global batch; they need sampler distributed")
        if sized != "auto" and len(sized) != world:
            fail("rank_micro_batch", f"{len(sized)} entries for world_size {world}: one micro-batch per rank")
        if sized != "auto" and sum(sized) != spec.micro_batch * world:
            fail("rank_micro_batch", f"the ranks' micro-batches sum to {sum(sized)}, but micro_batch x world_size "
                 f"= {spec.micro_batch * world}: keep the global batch of the uniform run")
    if threads is not None:
        if spec.device != "cpu":
            fail("rank_cpu_threads", "per-rank thread counts make unequal CPU devices; device must be cpu")
        if len(threads) != world:
            fail("rank_cpu_threads", f"{len(threads)} entries for world_size {world}: one thread count per rank")
    if budget is not None:
        if spec.device != "cpu":
            fail("rank_cpu_budget", "per-rank CPU budgets make unequal CPU devices; device must be cpu")
        if len(budget) != world:
            fail("rank_cpu_budget", f"{len(budget)} entries for world_size {world}: one budget per rank")
    if spec.link is None:
        return
    if world < 2:
        fail("link", "a 1-rank run sends nothing over a link; give it world_size 2 or more, or no link")
    if spec.launcher != "torchrun":
        fail("link", f"a link runs one torchrun agent per host namespace; launcher {spec.launcher} is not "
             "supported (Ray across two namespaced hosts: `snakemake two_hosts`)")
    if spec.device != "cpu":
        fail("link", "NCCL moves GPU data over PCIe/NVLink/shared memory, which no network namespace shapes: "
             "links are for CPU ranks (gloo over TCP)")


def machine_refusal(spec: SpecFields) -> tuple[str, str] | None:
    """(field, why) when this machine cannot give the experiment what it asks (network
    namespaces for a link, cpu cgroups for CPU budgets: root), else None. The default stages
    are refused when the config loads; the opt-in ones when their target asks for them
    (rules/common.smk stage_metrics), so that a config naming them still runs elsewhere."""
    if spec.link is not None:
        from distlab.configuration.netns import refusal

        if refusal():
            return "link", f"network namespaces cannot be made here: {refusal()}"
    if spec.rank_cpu_budget is not None:
        from distlab.configuration.cpu_budget import refusal as no_cpu_budget

        if no_cpu_budget():
            return "rank_cpu_budget", f"CPU budgets cannot be enforced here: {no_cpu_budget()}"
    return None


def split_batch(total: int, speeds: list[float], capacities: list[int | None]) -> list[int]:
    """Split `total` samples over ranks in proportion to speed (largest remainders), each at
    least 1 and at most its capacity (None: unbounded); what a full rank cannot take goes to
    the fastest with room."""
    n = len(speeds)
    if total < n:
        raise ValueError(f"a global batch of {total} cannot give each of {n} ranks a sample")
    room = [math.inf if c is None else c for c in capacities]
    if any(r < 1 for r in room) or sum(min(r, total) for r in room) < total:
        raise ValueError(f"the ranks' memory holds {capacities} samples each: less than the global batch of "
                         f"{total} (or a rank holds none)")
    quotas = [total * s / sum(speeds) for s in speeds]
    sizes = [min(room[i], max(1, math.floor(q))) for i, q in enumerate(quotas)]
    while sum(sizes) < total:  # the largest shortfall against its quota first, among ranks with room
        sizes[max((i for i in range(n) if sizes[i] < room[i]), key=lambda i: quotas[i] - sizes[i])] += 1
    while sum(sizes) > total:  # the floor of 1 overshot: take back from the largest excess
        sizes[max((i for i in range(n) if sizes[i] > 1), key=lambda i: sizes[i] - quotas[i])] -= 1
    return sizes

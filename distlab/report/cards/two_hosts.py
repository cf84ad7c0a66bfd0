"""Two hosts, one Ray cluster (`snakemake two_hosts`, distlab/jobs/two_hosts.py): which host ran
which rank in every worker group, what each host did and sent, and the node leaving and
rejoining. Not a `stage*` module: the milestone report does not show it; its page does."""
from __future__ import annotations

from distlab.report.cards import FAILED, PASSED, Card, Figure, Goal, Table, metrics_link
from distlab.report.cards.stage5_ray import elastic_figure
from distlab.report.report_run import ReportRun


def build(run: ReportRun | None, record: dict) -> Card:
    import pandas as pd

    card = Card(5, "Two hosts, one Ray cluster (home PC + cloud box, rehearsed on one machine)")
    hosts = record["hosts"]
    names = ", ".join(f"{h['name']} ({h['address']})" for h in hosts)
    if run is None:
        card.goals.append(Goal("minimal", "A Ray Train run across two hosts", FAILED,
                               "the run left no readable metrics"))
        return card
    ray = run.section("ray")
    attempts = ray["attempts"]
    # Each rank's host by the name the run gave it (metrics.json ray block: no addresses).
    both = [a for a in attempts if {r["host"] for r in a["ranks"]} == {h["name"] for h in hosts}]
    card.goals.append(Goal("minimal", "A Ray Train run across two hosts, each with its own address", PASSED if both
                           else FAILED, f"{run.experiment}: {len(both)} of {len(attempts)} worker group(s) had a "
                           f"rank on each of {names}; Ray head on {hosts[0]['name']}, worker node on "
                           f"{hosts[1]['name']}", [metrics_link(run)]))
    changes = [(c["from"], c["to"]) for c in ray["world_size_changes"]]
    rejoined = changes[:2] == [(2, 1), (1, 2)]
    card.goals.append(Goal("bonus", "The worker node left mid-run and rejoined; training went on (elastic)",
                           PASSED if rejoined else FAILED,
                           "; ".join(f"{c['from']}->{c['to']} workers at step {c['step']} (resumed from a "
                                     f"checkpoint: {c['resumed_from_checkpoint']})" for c in ray["world_size_changes"])
                           or "the worker group never changed size", [metrics_link(run)]))
    steps = run.spec.steps
    rows, part = [], {h["name"]: {"worker groups": 0, "steps trained": 0} for h in hosts}
    for i, (attempt, nxt) in enumerate(zip(attempts, attempts[1:] + [None])):
        end = nxt["start_step"] if nxt else steps
        rows.append({"group": i + 1, "workers": attempt["world_size"], "steps": f"{attempt['start_step']}-{end - 1}",
                     "resumed": attempt["resumed"],
                     "ranks": ", ".join(f"rank {r['rank']} on {r['host']}" for r in attempt["ranks"])})
        for name in {r["host"] for r in attempt["ranks"]}:
            part[name]["worker groups"] += 1
            part[name]["steps trained"] += end - attempt["start_step"]
    card.tables.append(Table("Worker groups", pd.DataFrame(rows),
                             "from the workers' own start records (each rank's host); a group resumes from the "
                             "newest checkpoint Ray hands back"))
    link = {h["host"]: h for h in record["link"]["per_host"]}
    card.tables.append(Table("Each host's part (both machines, one run)", pd.DataFrame([
        {"host": h["name"], "address": h["address"], **part[h["name"]],
         "MB sent": round(link[h["name"]]["tx_bytes"] / 1e6, 1),
         "MB received": round(link[h["name"]]["rx_bytes"] / 1e6, 1)}
        for h in hosts]), record["link"]["how"] + f"; link capped at {record['link']['bandwidth_mbit']} Mbit/s each way"
        if record["link"]["bandwidth_mbit"] else record["link"]["how"] + "; link uncapped"))
    start = record["events"][0]["time"]
    card.tables.append(Table("What happened to the nodes", pd.DataFrame([
        {"event": e["event"], "seconds": round(e["time"] - start, 1), "host": e.get("host", ""),
         "newest checkpoint's workers": "-" if e["newest_checkpoint_world"] is None else e["newest_checkpoint_world"]}
        for e in record["events"]]),
        "the orchestrator's own clock; each stage waits for a checkpoint of the group size before the next"))
    card.figures.append(Figure("Worker-group size over the run", elastic_figure([run]),
                               "ranks of each worker group from the workers' start records"))
    st = run.timing.step_time_s
    card.notes.append(f"Last group's median step {st.median * 1000:.1f} ms over {st.n} timed steps; "
                      f"TorchTrainer.fit() took {ray['fit_seconds']:.1f} s. Final loss {run.loss.last:.3f} "
                      f"(first {run.loss.first:.3f}). Each host is a network namespace of this machine joined by "
                      "a veth pair through a bridge (distlab/launchers/links.py): the addresses, sockets and the link "
                      "are real, the CPU and disk are shared, so this shows the mechanics of two machines, not a real "
                      "WAN.")
    return card


"""metrics.json's `ray` block: what Ray really did, from the workers' own start records.

Where each rank ran is recorded by Ray node id (random per node start) and host label: the
workers report their node's IP address, which the driver turns into a label before anything is
written (distlab.records.sharing: shared results carry no address of the cluster's machines)."""
from __future__ import annotations


def attempts_from_events(events: list[dict]) -> list[dict]:
    """Group rank_started events into worker-group attempts, in time order."""
    attempts = []
    for event in sorted((e for e in events if e["event"] == "rank_started"), key=lambda e: e["time"]):
        current = attempts[-1] if attempts else None
        same = (current and current["world_size"] == event["world_size"]
                and current["start_step"] == event["start_step"] and event["rank"] not in current["ranks"])
        if not same:
            current = {"world_size": event["world_size"], "start_step": event["start_step"],
                       "resumed": event["resumed"], "ranks": {}}
            attempts.append(current)
        current["ranks"][event["rank"]] = {k: event[k] for k in ("node_id", "host", "pid")}
        for key in ("from_world_size", "earlier_losses"):
            if key in event:
                current[key] = event[key]
    for attempt in attempts:
        attempt["ranks"] = [dict(rank=r, **attempt["ranks"][r]) for r in sorted(attempt["ranks"])]
        attempt["nodes"] = sorted({r["node_id"] for r in attempt["ranks"]})
    return attempts


def host_labels(nodes: list[dict], events: list[dict], names: dict | None = None) -> dict[str, str]:
    """Node IP address -> the label results carry in its place: `names` where the job names its
    hosts (the two-host run: home-pc, cloud-box), else host-1 for the Ray head's host and
    host-2, host-3, ... for the others in order of first appearance (the cluster's node list,
    then the workers' records in time order). Nodes on one address share its label."""
    names = names or {}
    order = [n["node_ip"] for n in nodes if n["head"]] + [n["node_ip"] for n in nodes]
    order += [e["node_ip"] for e in sorted(events, key=lambda e: e["time"]) if "node_ip" in e]
    labels: dict[str, str] = {}
    for address in order:
        labels.setdefault(address, names.get(address) or f"host-{len(labels) + 1}")
    return labels


def labelled(record: dict, labels: dict[str, str]) -> dict:
    """`record` with its node_ip replaced by the host label."""
    if "node_ip" not in record:
        return record
    out = {k: v for k, v in record.items() if k != "node_ip"}
    out["host"] = labels[record["node_ip"]]
    return out


def ray_record(outcome: dict, cluster: dict, host_names: dict | None = None) -> dict:
    """metrics.json's `ray` block: what Ray really did, from the workers' own reports; hosts by
    label (host_labels), never by address."""
    import ray

    labels = host_labels(outcome["nodes"], outcome["events"], host_names)
    events = [labelled(e, labels) for e in outcome["events"]]
    nodes = [labelled(n, labels) for n in outcome["nodes"]]
    attempts = attempts_from_events(events)
    final = attempts[-1] if attempts else None
    heads = sorted({n["host"] for n in nodes if n["head"]})
    return {
        "launcher": "ray",
        "ray_version": ray.__version__,
        "cluster": dict(cluster, head_host=heads[0] if heads else None),
        "nodes_in_cluster": nodes,
        "hosts": {"labels": sorted(set(labels.values())),
                  "how": "each Ray node's host by label, not address: the job's own host names where it names "
                         "them, else host-1 for the Ray head's host and host-2, ... for the others in order of "
                         "first appearance; nodes on one address share a label (node_id tells them apart)"},
        "scaling": outcome["scaling"],
        "max_failures": outcome["max_failures"],
        "storage_path": outcome["storage_path"],
        "world_size": final["world_size"] if final else None,
        "ranks": final["ranks"] if final else [],
        "distinct_nodes": len(final["nodes"]) if final else 0,
        "attempts": attempts,
        "restarts": max(0, len(attempts) - 1),
        "world_size_changes": [{"step": after["start_step"], "from": before["world_size"], "to": after["world_size"],
                                "resumed_from_checkpoint": after["resumed"]}
                               for before, after in zip(attempts, attempts[1:])
                               if before["world_size"] != after["world_size"]],
        "faults_injected": [e for e in events if e["event"] == "fault_injected"],
        "checkpoints": [e for e in events if e["event"] == "checkpoint"],
        "fit_seconds": outcome["fit_seconds"],
        "how": "ranks, nodes and groups from the workers' own start records (RunLog actor); fit_seconds = wall "
               "time of TorchTrainer.fit() in the driver; metrics and steps returned by rank 0 "
               "(Result.return_value); checkpoints written into the run folder and reported to Ray",
    }


def earlier_rows(attempts: list[dict], steps: list[dict], total: int) -> list[dict]:
    """Loss rows of the steps before the last elastic resize, from the records that resize's
    checkpoint carried (later groups override earlier ones). Renumbers `steps`, which an
    elastic group counts from its own first step."""
    if len(steps) < total:
        for row in steps:
            row["step"] += total - len(steps)
    first = steps[0]["step"] if steps else total
    rows = {}
    for attempt in attempts:
        for row in attempt.get("earlier_losses") or []:
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows) if k < first]

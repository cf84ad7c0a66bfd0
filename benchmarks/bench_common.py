"""What the benchmarks share: their command lines and the order of interleaved launches."""
import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rounds_parser(doc: str, out_name: str, steps: int, warmup: int, rounds: int = 3) -> argparse.ArgumentParser:
    """--rounds/--steps/--warmup/--out of a benchmark that interleaves separate launches."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=rounds, help="independent launches of every arm")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps at the start of each launch")
    p.add_argument("--out", default=str(REPO / "results" / "benchmarks" / out_name))
    return p


def loop_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a hand-written training loop launched under torchrun (bare_ddp, trainer_run)."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    return p


def round_order(arms: list, round_index: int) -> list:
    """The arms rotated by one each round and reversed every other round: no arm always runs
    first or right after the same neighbour, so drift on a shared machine hits all of them."""
    k = round_index % len(arms)
    order = arms[k:] + arms[:k]
    return order if round_index % 2 == 0 else order[::-1]

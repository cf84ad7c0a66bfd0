"""`distlab-check-config FILE...`: every check the workflow runs before a job, for files given
with `--configfile`.

Snakemake reads a `--configfile` itself, before any of distlab's code runs, and its message
for a YAML syntax error names neither the file nor the line ("Config file is not valid JSON or
YAML"). The embedded default (config/config.yaml) is checked by the Snakefile; for any other
file this command gives the file, line and column, then runs the same schema, semantic and
machine checks as the workflow (`distlab.configuration.config.load(..., probe=True)`).
"""
from __future__ import annotations

import argparse
import sys

from distlab.configuration.config import ConfigError, load
from distlab.configuration.input_checks import yaml_file


def check(path: str) -> str:
    """One file's verdict line; raises ConfigError naming the file."""
    try:
        _, specs = load(yaml_file(path), probe=True)
    except ConfigError as error:
        message = str(error)
        raise ConfigError(message if path in message else f"{path}: {message}") from None
    return f"{path}: ok, {len(specs)} experiment(s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distlab-check-config", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="config files you would pass with --configfile")
    failed = 0
    for path in parser.parse_args(argv).files:
        try:
            print(check(path))
        except (ConfigError, OSError) as error:
            failed += 1
            print(f"error: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

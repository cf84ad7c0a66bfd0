"""The scripts Snakemake runs send their output to the rule's log: `with logged(snakemake):`."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback


@contextlib.contextmanager
def logged(snakemake):
    """Redirect stdout/stderr (Python and child processes) to snakemake.log[0]. The script
    dies with Snakemake (PR_SET_PDEATHSIG): a SIGKILLed snakemake leaves no job running."""
    from distlab.launchers.process import die_with_parent
    from distlab.sharing import private_files

    die_with_parent(parent_names="snakemake")
    private_files()  # as the Snakemake process that started it, also where a cluster started it
    path = snakemake.log[0]
    os.environ["DISTLAB_JOB_THREADS"] = str(snakemake.threads)  # the job's cores, for its CUDA ranks
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as log:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
        try:
            yield path
        except BaseException:
            # The rule's log must say why the script failed, not only Snakemake's summary.
            traceback.print_exc()
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)

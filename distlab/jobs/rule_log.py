"""The scripts Snakemake runs send their output to the rule's log: `with logged(snakemake):`.

What distlab itself writes there (its messages, launch lines, Python logging records and
warnings of the rule's process, the traceback of a failure) names paths of the checkout, the working
folder and the home folder
relative to them, as the shared results do (distlab.records.sharing); what child processes and
libraries print straight to the file stays as they print it."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback

from distlab.records.sharing import portable, private_files


class PortableFormatter(logging.Formatter):
    """Logging records with local absolute paths written relative (distlab.records.sharing.portable)."""

    def format(self, record: logging.LogRecord) -> str:
        return portable(super().format(record))


@contextlib.contextmanager
def logged(snakemake):
    """Redirect stdout/stderr (Python and child processes) to snakemake.log[0]. The script
    dies with Snakemake (PR_SET_PDEATHSIG): a SIGKILLed snakemake leaves no job running."""
    from distlab.launchers.process import die_with_parent

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
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PortableFormatter(logging.BASIC_FORMAT))
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
        logging.captureWarnings(True)  # Python warnings of this process too (a library's path -> ~/...)
        try:
            yield path
        except BaseException:
            # The rule's log must say why the script failed, not only Snakemake's summary.
            sys.stderr.write(portable(traceback.format_exc()))
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)

"""Runs while the Snakefile parses (rules/common.smk imports it) and in `distlab-check-config`,
before any job starts: the config schema, its defaults and its expansion into experiment specs,
the fine-tuning keys, which strategies fit a model family, which checkpoints get validated, the
checks of everything a job would read (model folders, data files, tokenizers, links, unequal
devices) and the results folder's one-workflow lock; the precision map every later phase reads
(precision.py: its torch dtypes are imported inside its functions); what this machine has
(hardware.py: GPU count and machine tag at parse time, the probe of rule hardware, a rank's NVML
handle and peak FLOPs; torch and pynvml inside its functions); what this machine's kernel lets a run
do: per-rank CPU budgets (cpu_budget.py: cgroups; the ranks enter them, the launcher sweeps them)
and network namespaces for links (netns.py: whether they can be made; distlab.launchers.links makes
them). Light on purpose: a check that needs torch,
transformers or datasets imports them inside its function, so parsing never pays for them.
"""

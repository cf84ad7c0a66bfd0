"""Runs in every phase, on either side of the files a run leaves: the typed contract between phases
(`Spec`, one experiment's resolved settings; `Job` / `ValidationJob`, what a launch hands its ranks;
`RunRecord`, metrics.json read back), where a run's side files lie (the
Snakefile declares them, ranks write them), metrics.json's one writer and one reader with the
metrics formulas and schema version, the per-phase memory peaks as recorded, and what makes
results shareable between machines (umask, no host names or local paths); a checkpoint folder's
manifest, atomic writes and step folders (checkpoint_files), and the safetensors layout of an
export with its weight index (export_files), which the validation job, config checks of a model
folder and the ranks all read; and the machine files as later phases read them: advice.json's
rows and labels (advice), collectives.json at any message size (collectives), a run's step-time
prediction scored against what it measured (predictions). Torch-free at import, so the
Snakefile, a job, a rank and the report can all import it.
"""

"""Rule summary: one row per run across every machine folder (pandas)."""
from distlab.evaluation import eval_columns
from distlab.report.collect import load_runs, summary_frame
from distlab.smk import logged

with logged(snakemake):
    runs = load_runs(list(snakemake.input.mine) + list(snakemake.input.shared))
    frame = eval_columns(summary_frame(runs), runs)
    frame.to_csv(snakemake.output[0], index=False)
    print(frame.to_string())

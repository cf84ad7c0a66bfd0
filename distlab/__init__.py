"""distlab: the distributed-training roadmap as one reproducible Snakemake pipeline."""

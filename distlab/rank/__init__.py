"""Runs inside a rank, at its top: the entry modules a launcher starts (`python -m
distlab.rank.worker` for training, `distlab.rank.validate_ranks` for checkpoint validation; a Ray
Train worker calls `worker.run_rank`), the one training loop, the model built, LoRA applied and
wrapped (model_setup), what is reported between steps (monitor), a rank's checkpoint duties and
what a run measured (run_summary). They drive a strategy and a task, built from distlab.runtime's
kernels, and ask the advisor's step-time model (distlab.tools.step_time) for rank 0's prediction:
so this package sits above all of those. The launchers start its entry modules by name in a new
process; only the Ray driver imports one (ray_worker.train_worker), to hand Ray Train the function
(tests/test_layers.py lists that import, with why).
"""

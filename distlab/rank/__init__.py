"""Runs inside a rank, at its top: the entry modules a launcher starts by name (`python -m
distlab.rank.worker` for training, `distlab.rank.validate_ranks` for checkpoint validation,
`distlab.rank.ray_train` for the Ray Train driver, whose workers run ray_worker.train_worker and
so worker.run_rank), the one training loop, the model built, LoRA applied and wrapped
(model_setup), what is reported between steps (monitor), a rank's checkpoint duties and what a run
measured (run_summary). They drive a strategy and a task, built from distlab.runtime's kernels,
and ask the advisor's step-time model (distlab.tools.step_time) for rank 0's prediction: so this
package sits above all of those, and the launchers, which start it in a new process by module
name, import none of it.
"""

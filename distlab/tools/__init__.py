"""Runs on its own, outside a training run: the strategy advisor (rules advise and advise_sd; its
estimates also held to measured runs by the report) with its save estimate, the step-time model
(rank 0 of every run predicts its step with it: distlab.rank.worker) and the compute probe it
reads, the collective bandwidth benchmark, the KubeRay manifests and their CRD check, and the GPU
check kit (preflight, closing figures, CPU twins of the GPU presets). The advisor counts a model's
parameters and activations with distlab.runtime's kernels (parameter_counts, activations), which a
rank sizes its own batch by too; what the report reads of the advisor's files is distlab.records'.
"""

"""Runs on its own, outside a training run: the strategy advisor (rules advise and advise_sd; its
estimates also held to measured runs by the report) with its parameter counts and save estimate,
the collective bandwidth benchmark, the KubeRay manifests and their CRD check, and the GPU check
kit (preflight, closing figures, CPU twins of the GPU presets).
"""

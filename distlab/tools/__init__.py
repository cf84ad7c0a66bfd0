"""Runs on its own, outside a training run: the strategy advisor (rules advise and advise_sd; its
estimates also held to measured runs by the report) with its parameter counts and save estimate,
the hardware probe (rule hardware; the config reads its machine tag, ranks their device's peak),
the collective bandwidth benchmark, the KubeRay manifests and their CRD check, and the GPU check
kit (preflight, closing figures, CPU twins of the GPU presets).
"""

"""Runs where a checkpoint is saved or loaded (inside training ranks: periodic, parity and final
saves, resume; inside validation ranks: reloads): the checkpoint's identity and layout, the
trainer state, loading that runs no code, and the Hugging Face export pass. The folder's manifest
and the safetensors file layout are records (distlab.records.checkpoint_files, export_files). Each strategy's native
`state/` format is in distlab.checkpoint_formats.
"""

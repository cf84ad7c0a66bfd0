"""Runs where a checkpoint is saved or loaded (inside training ranks: periodic, parity and final
saves, resume; inside validation ranks: reloads) and where one is checked (the validation job):
a checkpoint folder's layout, its manifest and atomic writes, the trainer state, loading that
runs no code, and the Hugging Face export written tensor by tensor. Each strategy's native
`state/` format is in distlab.checkpoint_formats.
"""

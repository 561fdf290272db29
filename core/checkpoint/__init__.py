"""Checkpoints: the Checkpointer, DCP without code execution, folders and integrity, retention, resume, weights."""

"""The training loop: assembly, parallelization, the trainer, the step, metrics, validation, monitors."""

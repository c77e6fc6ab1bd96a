"""Training: the torchrun entrypoint (`python -m pipeline.train`), the loop and distributed setup."""

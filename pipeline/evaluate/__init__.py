"""Evaluation: classification metrics on the held-out split and the promotion gate."""

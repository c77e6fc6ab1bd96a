"""Launching training: local torchrun supervision (and, later, Kubernetes pod specs)."""

"""Reference workloads: each recipe is a config function plus its model, data columns and metrics."""

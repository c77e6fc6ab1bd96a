"""Metric directions (True: higher is better) by task; the gate and the config's metric names use them."""

CLASSIFICATION = {"accuracy": True, "macro_f1": True, "log_loss": False}

"""Metric directions (True: higher is better) by task; the gate and the config's metric names use them."""

CLASSIFICATION = {"accuracy": True, "macro_f1": True, "log_loss": False}
# Top-k retrieval over the whole catalogue; coverage is the share of the catalogue ever recommended.
RETRIEVAL = {"recall_at_10": True, "recall_at_50": True, "ndcg_at_10": True, "coverage_at_10": True}
# A causal LM: exact match of greedy generations against the references, held-out token loss and perplexity.
LANGUAGE_MODEL = {"exact_match": True, "loss": False, "perplexity": False}

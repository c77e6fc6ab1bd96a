"""Evaluation: one evaluator interface (classification, retrieval, language models), metrics, reports and
the promotion gate."""

"""Notebook features built on a ``Session``: sending work, training runs, budgets, status, benchmarks."""

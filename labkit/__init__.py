"""labkit: a Jupyter-first lab for distributed training."""

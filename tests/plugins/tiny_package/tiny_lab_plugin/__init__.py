"""A strategy (local SGD) and a model (a two-layer MLP) for labkit, found through entry points only."""

"""Ways of splitting the work: one module per strategy, its declaration (no torch) beside its ``apply``.

``catalog`` says how a strategy is declared and finds the installed ones (the
built-ins and any package's, by entry points); ``rank_side`` types what a
strategy's module offers the ranks; ``compose`` composes the parts on a rank.
"""

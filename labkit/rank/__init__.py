"""Everything that runs inside a rank process (torch lives here).

``runtime`` is the rank's own state (its settings come as ``wire.rank_settings.RankSettings``),
``requests`` the rank side of the functions ``wire.entry`` sends, ``failures`` how failed
user work is reported; ``loop`` the training loop; ``instruments/`` the recorders, timed
groups and the simulated slow network (``lab.link``).
"""

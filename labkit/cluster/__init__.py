"""The processes behind the ranks: where they run, how they start, stop and are replaced.

Notebook side, no torch: ``rank_cluster`` drives ipyparallel's ``Cluster``; ``placement``
decides ranks, backend and devices; ``control`` is the channel that reaches running work.
"""

"""What both sides share: the notebook's process and every rank import this package.

- ``entry``: the functions the notebook sends to the ranks (pickled by name);
- ``rank_settings``: what the notebook tells an engine when it makes it a rank (``RankSettings``);
- ``current``: where a rank's runtime lives (``RUNTIME_NAME``) and ``this_rank()``;
- ``store_keys``: the keys of the rank-0 store where requests and whereabouts are left;
- ``schema``: the typed shapes of what ranks send back (rows, reports, results);
- ``gpus``: which GPUs a process may use and which one a rank takes.

Nothing here imports torch or the rank's code: the notebook imports it freely.
"""

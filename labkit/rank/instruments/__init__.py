"""A rank's instruments: what its steps cost, what its collectives carry, and the slow link.

- ``timed_group`` (with ``p2p_batch``): the process group that times every collective;
- ``recorder``, ``gpu_recorder``, ``recorders``: per-step rows from CPU clocks or CUDA events,
  and which one a rank uses;
- ``run_instruments``: what a training run measures, or a stand-in that does nothing;
- ``step_timer``: step times without the rows;
- ``slow_link`` (with ``gpu_delay``): the simulated network inside the timed groups.
"""

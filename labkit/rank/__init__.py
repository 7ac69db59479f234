"""Everything that runs inside a rank process (torch lives here).

``entry`` holds the functions the notebook sends (importable without torch);
``runtime`` the rank's own state; ``loop`` the training loop; ``recorder``,
``timed_group`` and ``gpu_recorder`` the instruments; ``slow_link`` the simulated
slow network (``lab.link``).
"""

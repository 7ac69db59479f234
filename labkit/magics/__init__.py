"""``%lab`` and ``%%lab``: the notebook's magics, thin wrappers over ``labkit.Lab``.

    %load_ext labkit
    %lab start 4              start 4 ranks (gloo on CPU; nccl, one per GPU, with CUDA)
    %lab mesh dp=2 tp=2       build a named device mesh on every rank and draw it
    %lab train --strategy fsdp --model gpt --steps 50 [--verify] [--dashboard]
                              train a zoo model under a strategy (see Lab.train)
    %lab slow 2 30ms          make rank 2 a straggler (off to undo)
    %lab link 100Mbit 20ms    a simulated slow network between the ranks (off to undo; alone: show it)
    %lab seed 42 [--same]     seed every rank: 42 + rank (or 42 everywhere)
    %lab push helper np data  put notebook functions, classes, modules, values into every rank's namespace
    %lab run train.py --epochs 2   run a torchrun-style script, unmodified, on every rank
    %lab bench allreduce      time a collective over message sizes
    %%lab [--ranks 0,2] [--timeout 30]
    ...                       run the cell on every rank (or the given ones)
    %lab status               one row per rank
    %lab who [--ranks 0,2]    the ranks' variables, and where ranks differ
    %lab timeout 60           default time limit for each cell, in seconds
    %lab restart | stop       fresh processes | stop everything

The modules, by job:

- ``lab_magics``: ``LabMagics``, the dispatch of ``%lab`` / ``%%lab`` and the commands that call the ``Lab``;
- ``parsing``: the one argument parser (``CommandParser``, made by ``command_parser``): one-line
  mistakes with "did you mean", help of one line per option;
- ``commands``: each command's one-line summary; ``help``: ``%lab --help`` and the help of the
  commands read by hand;
- ``values``: words into values (time limits, rank lists, sizes, durations);
- ``parsers``, ``train_args``: the parsers of ``start``, ``bench``, ``push``, ``%%lab`` and ``train``;
- ``queue``: ``%lab tasks`` and ``%lab ensemble``; ``network``: ``%lab start``'s options for other
  machines and ``%lab join-command``; ``link``: the words of ``%lab link``;
- ``completion``: Tab in a ``%%lab`` cell completes from the ranks' names (an IPython matcher).
"""

from __future__ import annotations

from labkit.magics.lab_magics import LabMagics

__all__ = ["LabMagics"]

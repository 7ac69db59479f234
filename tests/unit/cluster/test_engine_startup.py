"""The command an engine started by another launcher (MPI, SSH, Slurm) or a joined machine runs first.

ipyparallel runs it as text in the new engine; a name that no longer resolves would only show when
such an engine starts, so its attribute path is checked here against the function it must reach.
"""

from labkit.wire.entry import STARTUP_COMMAND, install


def test_the_startup_command_reaches_the_rank_install():
    assert STARTUP_COMMAND.endswith(".install()")
    assert eval(STARTUP_COMMAND.removesuffix("()")) is install  # our own constant: resolved, not called

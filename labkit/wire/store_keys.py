"""The keys of the rank-0 store where the notebook and the ranks leave each other notes.

The notebook writes its requests to running work (stop, slow a rank) under the
control keys and reads each rank's whereabouts; a rank reads the requests between
steps and writes where it is (``cluster.control``, ``cluster.rank_whereabouts`` on
the notebook's side; ``rank.control``, ``rank.whereabouts`` on the rank's).
"""

REQUEST_KEY = "labkit/control"  # the whole request, one JSON value
VERSION_KEY = "labkit/control/version"  # bumped after each request is written, so a reader sees it whole
STOP_KEY = "stop"  # in the request: stop at the next step boundary
SLOW_KEY = "slow"  # in the request: rank (as text) -> seconds to add to each of its steps
WHERE_KEY = "labkit/where/{rank}"  # what a rank is doing now, sampled by its own thread
RELEASE_KEY = "labkit/release/{rank}"  # bumped by the notebook: close that rank's group connections
# A rank stopped at a breakpoint (rank.debugger): where it stopped (JSON; deleted when it goes on), the notebook's
# next pdb command for it, and its answer (runs.debugging, cluster.debug_line).
DEBUG_STOP_KEY = "labkit/debug/{rank}/stop"
DEBUG_COMMAND_KEY = "labkit/debug/{rank}/command"
DEBUG_ANSWER_KEY = "labkit/debug/{rank}/answer"
DEBUG_GIVE_UP_SECONDS = 5.0  # a stopped rank that cannot reach the store this long quits (rank 0, its server, ended)

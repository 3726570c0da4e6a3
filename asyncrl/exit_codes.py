"""Exit codes a role process ends with for its launcher (the local supervisor, the Ray launcher) to read."""

# The role could not be built from its inputs (model path, data files, environments, validation prompts) or its
# code could not be imported (a broken install): the same inputs would fail again, so a launcher reports it and
# does not restart the role. Also what `asyncrl rollout`, `asyncrl run` and `asyncrl launch` exit with when a
# server cannot start, or dies of the same error at its starts in a row (`asyncrl.restarts`: its engine cannot
# run the model).
CANNOT_START = 3

# The role stopped on SIGINT/SIGTERM before its work was done (128 + SIGINT, as shells report Ctrl-C).
INTERRUPTED = 130

# A rollout server's learner came back on other addresses: its supervisor restarts it on them at once, and does
# not count it as a death.
LEARNER_MOVED = 4

"""`asyncrl launch`: the roles (buffer, learner ranks, rollout servers) as Ray actors on a cluster.

Each actor runs its role as an ordinary `asyncrl` process in a session of its own, streams that
process's output to the driver and reports its node's address; the driver wires the addresses
together, restarts rollout servers and the buffer when they die, and tears everything down at the end.
Ray is imported only by `actor.py` and `launcher.py`, which the `launch` command imports lazily.
"""

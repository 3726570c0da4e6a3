"""Children joined in one thread while another sweeps them (`Process.start()` does, through `active_children`) keep
their exit codes: the root conftest installs `mp_reaping.one_reaper_at_a_time`. Without it, this run lost the code
of 10 to 21 of its 600 children on the 2-core box (`join()` returned with `exitcode` None)."""

import multiprocessing
import os
import sys
import threading

from mp_reaping import one_reaper_at_a_time

ROUNDS, AT_ONCE = 150, 4


def test_a_sweeping_thread_leaves_every_joined_child_its_exit_code():
    one_reaper_at_a_time()  # installed by the root conftest already: a second call changes nothing
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race, where it exists, shows
    fork = multiprocessing.get_context("fork")
    done = threading.Event()

    def sweep() -> None:
        while not done.is_set():
            multiprocessing.active_children()

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    codes = []
    try:
        for _ in range(ROUNDS):
            children = [fork.Process(target=os._exit, args=(index % 2 * 3,)) for index in range(AT_ONCE)]
            for child in children:
                child.start()
            for child in children:
                child.join()
                codes.append(child.exitcode)
    finally:
        done.set()
        sweeper.join()
        sys.setswitchinterval(interval)
    assert codes == [0, 3] * (ROUNDS * AT_ONCE // 2)

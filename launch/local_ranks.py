"""Local ranks of one command (`asyncrl learner`'s, the synchronous reference's): spawned, each to its end, and
how they ended."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Callable

from asyncrl.exit_codes import INTERRUPTED
from asyncrl.stop_signal import interrupt_on_stop_signals


def spawn_ranks(target: Callable[..., None], args: tuple, size: int, run_dir: str, role: str,
                log: logging.Logger) -> int:
    """Run `size` local ranks, `target(rank, size, store_port, *args)` each, to the end; the exit code: 0,
    INTERRUPTED when a stop signal ended them first, 1 when one failed (one line here; its error and traceback are in
    its log, logs/<role><rank>.log).

    SIGTERM (what `asyncrl run` sends the learner's process group) is taken like Ctrl-C, here and in every
    rank: a rank unwinds through its `finally` (buffer stopped, metrics closed, its process group left) and
    exits, and this process waits for that. A signal to this process alone (a process manager's) is passed on
    to the ranks. Killed outright, a rank left the multiprocessing resource tracker
    warning about a leaked semaphore (tqdm's, from loading the model) on the console."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from learner.distributed import spawner_store

    interrupt_on_stop_signals()
    store = spawner_store(size) if size > 1 else None  # held here until the ranks end
    context = mp.start_processes(target, args=(size, store.port if store else 0, *args), nprocs=size,
                                 start_method="spawn", join=False)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        for process in context.processes:  # a signal to this process alone (a process manager's) reaches them too
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in context.processes:
            process.join()
        return INTERRUPTED
    except ProcessException as error:  # torch ends the other ranks
        rank_log = Path(run_dir) / "logs" / f"{role}{error.error_index}.log"
        log.error("%s rank %d failed (%s): see %s", role, error.error_index, str(error).strip().splitlines()[0], rank_log)
        return 1
    return 0

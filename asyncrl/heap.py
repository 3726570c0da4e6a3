"""Keep a long-running role's startup objects out of the garbage collector's full passes.

A process that imported torch, transformers or vLLM holds several hundred thousand objects that live
as long as it does. CPython's full (generation 2) collection walks every one of them, and the
process's loop stands still meanwhile: ~250 ms in a rollout server on the 2-core dev box, ~140 ms in
the learner, ~13 ms in the buffer (docs/benchmarks.md). Freezing moves the objects alive at the end of
startup into a permanent generation that collections skip, so later full collections walk only what
the role allocated since. Frozen objects are still freed by reference counting when their last
reference goes; only reference cycles among them would outlive their use, and startup leaves few.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze every object alive now; return how many are frozen.

    Call once per process, when the role has built its long-lived state and is about to serve."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d startup objects: full collections no longer walk them", frozen)
    return frozen

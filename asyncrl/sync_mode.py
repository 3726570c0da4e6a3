"""`learner.mode=sync`: the synchronous reference (generate a batch, train on it, sync, repeat) on the
same code path as async training: a staleness bound of 0 lets servers start only the next batch, and
a sync after every step gives them the weights that batch needs."""

from __future__ import annotations

import dataclasses
import logging

from asyncrl.config import AsyncRLConfig


def apply_mode(config: AsyncRLConfig, log: logging.Logger) -> AsyncRLConfig:
    if config.learner.mode != "sync":
        return config
    if config.buffer.max_staleness != 0 or config.learner.sync_every != 1:
        log.info("learner.mode=sync: using buffer.max_staleness=0 and learner.sync_every=1")
    return dataclasses.replace(
        config,
        buffer=dataclasses.replace(config.buffer, max_staleness=0),
        learner=dataclasses.replace(config.learner, sync_every=1),
    )

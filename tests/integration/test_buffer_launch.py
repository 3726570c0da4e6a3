"""How the learner gets its buffer: the configured address (not watched), or a buffer process it starts and
keeps running."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config import load_config
from demo.synthetic import synthetic_group
from asyncrl.transport import BufferConsumer, TrajectoryProducer
from launch.commands.buffer import COMMAND_LINE
from learner.services.buffer_supervisor import connect_or_supervise_buffer

pytestmark = pytest.mark.slow


def test_a_configured_address_is_used_as_is(tmp_path):
    config = load_config(None, ["buffer.address=tcp://127.0.0.1:5999"])
    assert connect_or_supervise_buffer(config, tmp_path, COMMAND_LINE) == ("tcp://127.0.0.1:5999", None)


def test_without_an_address_a_buffer_is_started_for_the_run(tmp_path):
    config = load_config(None, ["buffer.max_staleness=0"])
    address, supervisor = connect_or_supervise_buffer(config, tmp_path, COMMAND_LINE)
    try:
        # started from version 0 while the learner was at 1: outside the run's max_staleness=0
        late_start = dataclasses.replace(synthetic_group("x", completion_tokens=4, version=0), learner_version_at_start=1)
        TrajectoryProducer(address).send(late_start)
        consumer = BufferConsumer(address, "learner")
        consumer.publish_version(1)
        assert consumer.next_batch(policy_version=1).dropped_stale == 1  # the run's max_staleness=0 applies
        assert (tmp_path / "buffer" / "endpoint").exists() and (tmp_path / "config.yaml").exists()
    finally:
        assert supervisor.stop() == 0

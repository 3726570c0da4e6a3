"""The learner's sending ends: one per backend its servers receive on, made once, on first use."""

import pytest
import torch

from asyncrl.weight_transfer.backends import GLOO
from learner.weight_sync.sending_ends import SendingEnds


def test_each_backend_gets_one_end_made_on_first_use_and_closed_with_the_others():
    made: list[str] = []

    def make(name: str):
        made.append(name)
        return GLOO.sending_end()

    ends = SendingEnds("ipc", make)
    assert ends.in_use() == []
    gloo = ends.end("gloo")
    assert ends.end("gloo") is gloo and made == ["gloo"]
    ends.end("ipc")
    assert made == ["gloo", "ipc"] and ends.in_use() == ["gloo", "ipc"]
    ends.close()


def test_a_server_naming_no_backend_or_auto_gets_the_default_and_auto_is_resolved_here():
    colocated = SendingEnds("ipc", lambda name: GLOO.sending_end())
    assert [colocated.backend_of(announced) for announced in ("", "auto", "ipc", "nccl", "gloo")] == [
        "ipc", "ipc", "ipc", "nccl", "gloo"]
    ends = SendingEnds("auto", lambda name: GLOO.sending_end())
    assert ends.backend_of("") == ("nccl" if torch.cuda.is_available() else "gloo")  # as this process resolves auto
    with pytest.raises(ValueError, match="unknown weight-sync backend 'mpi'"):
        colocated.backend_of("mpi")

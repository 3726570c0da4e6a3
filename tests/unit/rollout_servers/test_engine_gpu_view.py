"""The synchronous reference starts each rank's engine before the rank opens CUDA (so that vLLM forks the engine's
core instead of spawning it), with the engine's processes narrowed to its GPUs while they start
(`_visible_to_children`). The rank's own view must survive that: the variable is put back afterwards, and a CUDA
context opened inside the narrowed window, which would keep the narrowed view for good, ends in an error naming it.
CUDA's state is a stand-in here (no GPU on the test machine): `torch.cuda.is_initialized` reads a flag the body sets."""

import os

import pytest
import torch

from asyncrl.gpu_ids import VISIBLE_DEVICES
from rollout_servers.reference_sampler import _visible_to_children


@pytest.fixture
def cuda(monkeypatch) -> dict[str, bool]:
    state = {"opened": False}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["opened"])
    return state


@pytest.mark.parametrize("previous", [None, "0,1,2,3"])
def test_the_children_see_only_the_engines_gpus_and_the_variable_is_put_back(monkeypatch, cuda, previous):
    if previous is None:
        monkeypatch.delenv(VISIBLE_DEVICES, raising=False)
    else:
        monkeypatch.setenv(VISIBLE_DEVICES, previous)
    with _visible_to_children([2]):
        assert os.environ[VISIBLE_DEVICES] == "2"
    assert os.environ.get(VISIBLE_DEVICES) == previous


def test_cuda_opened_while_the_view_is_narrowed_is_an_error_naming_the_variable(monkeypatch, cuda):
    monkeypatch.setenv(VISIBLE_DEVICES, "0,1")
    with pytest.raises(RuntimeError, match=f"{VISIBLE_DEVICES}=1, so it now sees those GPUs alone, not 0,1"):
        with _visible_to_children([1]):
            cuda["opened"] = True
    assert os.environ[VISIBLE_DEVICES] == "0,1"


def test_cuda_opened_where_the_view_does_not_change_is_no_error(monkeypatch, cuda):
    monkeypatch.setenv(VISIBLE_DEVICES, "3")  # one rank beside its engine: pinned to the engine's GPU already
    with _visible_to_children([3]):
        cuda["opened"] = True
    assert os.environ[VISIBLE_DEVICES] == "3"


def test_a_context_opened_before_keeps_its_view_and_is_no_error(monkeypatch, cuda):
    monkeypatch.setenv(VISIBLE_DEVICES, "0,1")
    cuda["opened"] = True
    with _visible_to_children([1]):
        pass
    assert os.environ[VISIBLE_DEVICES] == "0,1"


def test_without_gpus_nothing_changes(monkeypatch, cuda):
    monkeypatch.setenv(VISIBLE_DEVICES, "0,1")
    with _visible_to_children(None):
        cuda["opened"] = True
        assert os.environ[VISIBLE_DEVICES] == "0,1"

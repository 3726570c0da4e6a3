"""The plugin loading in place from the shared buffer of the ipc backend, with a CPU tensor for the learner's CUDA
buffer: for the plugin's unit tests and the load plan's test on vLLM's own model classes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncrl.weight_transfer import update_info_for
from asyncrl.weight_transfer.ipc import SharedWeightsReader, byte_layout, pack_into
from asyncrl.weight_transfer.protocol import InitInfo, UpdateInfo
from rollout_servers.vllm_plugin import AsyncRLWeightTransferEngine


class SharedBuffer(SharedWeightsReader):
    """The server's mapping of the learner's buffer, on the CPU, sized for rounds like `named`; the learner's rounds
    are packed into it here."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        sizes = [tensor.numel() * tensor.element_size() for _, tensor in named]
        super().__init__(torch.zeros(byte_layout(sizes)[1], dtype=torch.uint8))
        self.log: list[str] = []

    def write(self, named: list[tuple[str, torch.Tensor]]) -> UpdateInfo:
        """Pack a round into the buffer, as the learner's stage does; the update request announcing it."""
        pack_into(self.buffer, named)
        return UpdateInfo(**update_info_for(named))

    def synchronize(self) -> None:
        self.log.append("synchronize")


def plugin_on_buffer(buffer: SharedBuffer, model: torch.nn.Module, vllm_config: Any) -> AsyncRLWeightTransferEngine:
    """The plugin of worker 0 of an engine configured as `vllm_config` says, loading in place into `model`, mapped
    onto `buffer` as the ipc backend's init request would map the learner's."""
    plugin = AsyncRLWeightTransferEngine(None, vllm_config, buffer.device, model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SharedWeightsReader, "open", classmethod(lambda cls, fields, device, previous=None: buffer))
        plugin.init_transfer_engine(InitInfo("127.0.0.1", 0, 2, "ipc", 1.0, rank_offset=1, load_in_place=True))
    return plugin

"""Trainer → rollout-server weight transfer over a private torch.distributed group (torch only, no vLLM).

The learner uses `WeightSender`; the rollout servers' vLLM plugin joins the same group through
`TransferGroup.join` and reads the tensor list from the update info built by `update_info_for`.
"""

from asyncrl.weight_transfer.group import TRAINER_RANK, GroupAddress, TransferGroup, WeightTransferError
from asyncrl.weight_transfer.protocol import (
    BACKEND_NAME,
    TensorMeta,
    init_info_for,
    parse_update_info,
    update_info_for,
    weights_for_transfer,
)
from asyncrl.weight_transfer.sender import WeightSender

__all__ = [
    "BACKEND_NAME",
    "TRAINER_RANK",
    "GroupAddress",
    "TensorMeta",
    "TransferGroup",
    "WeightSender",
    "WeightTransferError",
    "init_info_for",
    "parse_update_info",
    "update_info_for",
    "weights_for_transfer",
]

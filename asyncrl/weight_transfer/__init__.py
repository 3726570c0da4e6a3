"""Trainer → rollout-server weight transfer (torch only, no vLLM).

`backends.weight_backend` names the backend of a job (gloo, NCCL or CUDA IPC); the learner's coordinator drives its
`SendingEnd`, and the rollout servers' vLLM plugin pulls the tensors from its `ReceivingEnd`, in the order of the
update info built by `update_info_for`.
"""

from asyncrl.weight_transfer.backends import weight_backend
from asyncrl.weight_transfer.group import TRAINER_RANK, GroupAddress, TransferGroup, WeightTransferError
from asyncrl.weight_transfer.interface import ReceivingEnd, SendingEnd, Staged, WeightBackend
from asyncrl.weight_transfer.protocol import (
    BACKEND_NAME,
    TensorMeta,
    init_info_for,
    parse_update_info,
    update_info_for,
    weights_for_transfer,
)

__all__ = [
    "BACKEND_NAME",
    "TRAINER_RANK",
    "GroupAddress",
    "ReceivingEnd",
    "SendingEnd",
    "Staged",
    "TensorMeta",
    "TransferGroup",
    "WeightBackend",
    "WeightTransferError",
    "init_info_for",
    "parse_update_info",
    "update_info_for",
    "weight_backend",
    "weights_for_transfer",
]

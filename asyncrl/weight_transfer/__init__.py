"""Trainer → rollout-server weight transfer (torch only, no vLLM).

`backends.weight_backend` names the backend of a job (gloo, NCCL or CUDA IPC); the learner's coordinator drives its
`SendingEnd`, and the rollout servers' vLLM plugin pulls the tensors from its `ReceivingEnd`, in the order of the
update info built by `update_info_for`.

The names below are imported on first use: `kinds` (what each backend is, where it works) must load without torch,
for the launcher's placement, and Python runs this file before any module of the package.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {  # each exported name → the module of this package that defines it
    "weight_backend": "backends",
    "TRAINER_RANK": "group", "GroupAddress": "group", "TransferGroup": "group", "WeightTransferError": "group",
    "ReceivingEnd": "interface", "SendingEnd": "interface", "Staged": "interface", "WeightBackend": "interface",
    "BACKEND_NAME": "protocol", "TensorMeta": "protocol", "init_info_for": "protocol",
    "parse_update_info": "protocol", "update_info_for": "protocol", "weights_for_transfer": "protocol",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)

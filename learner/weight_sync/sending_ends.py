"""The learner's sending end of every weight backend its servers receive on: one per backend in use, made when a
server first announces it. A server beside the learner receives by CUDA IPC and servers on GPUs of their own by NCCL,
in one job: each round sends the same weights through each end to the servers on it."""

from __future__ import annotations

from typing import Callable

from asyncrl.weight_transfer.backends import AUTO, weight_backend
from asyncrl.weight_transfer.interface import SendingEnd


class SendingEnds:
    def __init__(self, default: str, make: Callable[[str], SendingEnd]) -> None:
        """`default`: the backend of a server that announces none (`rollout.weight_sync.backend` as the learner's
        placement left it; `auto` there is nccl where this process sees CUDA, else gloo); `make(name)`: the sending end of backend `name`, called once per backend."""
        self.default, self._make = default, make
        self._ends: dict[str, SendingEnd] = {}

    def backend_of(self, announced: str) -> str:
        """The backend a server that announced `announced` receives on: the default where it named none or `auto`
        (started without a plan, it does not know where it runs; the learner's placement did); ValueError for a
        name no backend has."""
        return weight_backend(self.default if announced in ("", AUTO) else announced).name

    def end(self, backend: str) -> SendingEnd:
        """The sending end of `backend` (a name `backend_of` gave), made on first use and kept."""
        if backend not in self._ends:
            self._ends[backend] = self._make(backend)
        return self._ends[backend]

    def disconnect(self, backend: str) -> None:
        """Drop `backend`'s connection to its servers, if it has an end."""
        if backend in self._ends:
            self._ends[backend].disconnect()

    def in_use(self) -> list[str]:
        """The backends that have an end, in the order they were made."""
        return list(self._ends)

    def close(self) -> None:
        for end in self._ends.values():
            end.close()

"""Weight-sync wall time (pause → receive → resume) of a rollout engine, next to the transfer floor.

Two measurements in one run, on the same model's tensors:
  floor        two plain processes (trainer on the learner's device, receiver on the server's) in an
               `asyncrl.weight_transfer` group: every tensor broadcast one by one, as a sync sends them,
               and all bytes as one flat buffer (the collective's own floor)
  engine       a `RolloutEngine` (vLLM AsyncLLM) serving the model, streaming --inflight requests, and a
               trainer process: each round the trainer stages the weights on its device as the learner's
               coordinator does (`rollout.weight_sync.staging_bytes`), then the engine pauses in keep mode,
               receives every tensor through the vLLM plugin, and resumes; the pause-to-resume time is what
               generation loses per sync. The trainer holds the weights on its GPU, as the learner does when
               they fit in rollout.weight_sync.staging_bytes (--trainer-weights cpu: in CPU memory, as the
               learner holds weights too large for it)
On GPU: the engine uses cuda:0 and the trainer cuda:1 (NCCL); on CPU both are gloo processes.
--colocated: trainer and engine share cuda:0, as a one-GPU job does. There is no NCCL floor then; the engine is
synced first through gloo (the baseline: weights through CPU memory), then through CUDA IPC (the trainer copies
each round into its shared buffer before inviting the engine, which loads from its mapping of that buffer).
Rounds are timed after one untimed warm-up round. Last line: RESULT {json} with weight_sync_ms (median
pause-to-resume), nccl_floor_ms (median per-tensor floor), flat_floor_ms, and the bytes sent; colocated,
colocated_weight_sync_ms, gloo_weight_sync_ms and ipc_vs_gloo instead of the floors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from dataclasses import dataclass

import torch

from asyncrl.config import load_config
from asyncrl.net import free_port
from asyncrl.weight_transfer import GroupAddress, TransferGroup, WeightSender, init_info_for, update_info_for, weights_for_transfer
from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment
from asyncrl.weight_transfer.group import GLOO, IPC
from asyncrl.weight_transfer.ipc import SharedWeights
from asyncrl.weight_transfer.sender import stage_for_transfer

SPAWN = multiprocessing.get_context("spawn")  # CUDA and vLLM both need fresh processes
HOST = "127.0.0.1"
TRAINER_RANK, RECEIVER_RANK = 0, 1
WAIT_S = 600  # longest wait for a child's answer: no phase may hang the benchmark
MS = 1000


@dataclass
class Placement:
    backend: str  # what is measured: "nccl", "gloo" or "ipc"
    trainer: torch.device  # the learner's device
    receiver: torch.device  # the rollout server's device (the engine's, on GPU: cuda:0)
    baseline: str = ""  # a backend measured first on the same engine, for comparison ("" = none)

    @property
    def backends(self) -> list[str]:
        return [self.baseline, self.backend] if self.baseline else [self.backend]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml", help="asyncrl config giving the engine settings")
    parser.add_argument("--model", required=True, help="Hugging Face model directory served and sent")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the sent tensors")
    parser.add_argument("--rounds", type=int, default=5, help="timed sync rounds per measurement")
    parser.add_argument("--inflight", type=int, default=32, help="requests streaming while the engine syncs")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each rendezvous and round")
    parser.add_argument("--trainer-weights", choices=("device", "cpu"), default="device",
                        help="where the trainer holds the weights between rounds: device (its GPU), as the learner does "
                             "when they fit in rollout.weight_sync.staging_bytes; cpu, as it does otherwise")
    parser.add_argument("--colocated", action="store_true",
                        help="trainer and engine share GPU 0: measure CUDA IPC against gloo on the same engine")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. rollout.engine.dtype=bfloat16")
    return parser.parse_args()


def placement(colocated: bool) -> Placement:
    if colocated:
        return Placement(IPC, torch.device("cuda", 0), torch.device("cuda", 0), baseline=GLOO)
    if torch.cuda.device_count() >= 2:
        return Placement("nccl", torch.device("cuda", 1), torch.device("cuda", 0))
    return Placement(GLOO, torch.device("cpu"), torch.device("cpu"))


def load_tensors(model_dir: str, dtype: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    return weights_for_transfer(model)


def group_address(where: Placement, timeout_s: float) -> GroupAddress:
    return GroupAddress(HOST, free_port(), world_size=2, backend=where.backend, timeout_s=timeout_s)


# floor phase: two plain processes -----------------------------------------------------------------------

def floor_member(rank: int, address: GroupAddress, device: torch.device, model_dir: str, dtype: str, rounds: int, results) -> None:
    prepare_nccl_environment(address.host)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensors = [tensor for _, tensor in load_tensors(model_dir, dtype, device)]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
    group = TransferGroup.join(address, rank, device)
    per_tensor = [_timed_round(group, tensors) for _ in range(rounds + 1)][1:]
    one_buffer = [_timed_round(group, [flat]) for _ in range(rounds + 1)][1:]
    group.close()
    if rank == TRAINER_RANK:
        results.put({"per_tensor_s": per_tensor, "flat_s": one_buffer,
                     "bytes": sum(t.numel() * t.element_size() for t in tensors), "tensors": len(tensors)})


def _timed_round(group: TransferGroup, tensors: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for tensor in tensors:
        group.broadcast(tensor)
    group.synchronize()
    return time.perf_counter() - started


def measure_floor(args: argparse.Namespace, where: Placement) -> dict:
    results = SPAWN.Queue()
    address = group_address(where, args.timeout_s)
    members = [SPAWN.Process(target=floor_member, args=(rank, address, device, args.model, args.dtype, args.rounds, results))
               for rank, device in ((TRAINER_RANK, where.trainer), (RECEIVER_RANK, where.receiver))]
    for process in members:
        process.start()
    floor = results.get(timeout=WAIT_S)
    for process in members:
        process.join(WAIT_S)
    return floor


# engine phase: a RolloutEngine and a trainer process ------------------------------------------------------

def trainer(address: GroupAddress, device: torch.device, held_on: torch.device, staging_bytes: int, model_dir: str,
            dtype: str, commands, results) -> None:
    """Each round: stage (as the learner's coordinator does before inviting servers), say so, send. With IPC the
    stage is the copy into the shared buffer and nothing is sent after it (its time is reported as the send)."""
    prepare_nccl_environment(address.host)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    named = load_tensors(model_dir, dtype, held_on)
    results.put(update_info_for(named))
    if address.backend == IPC:
        shared = SharedWeights()
        shared.reserve(named)
        results.put(shared.handle.as_dict())
        while commands.get() is not None:
            written_s = shared.write(named)
            results.put("staged")
            results.put(written_s)
        shared.close()
        return
    sender = WeightSender.open(address, device)
    while commands.get() is not None:
        staged = stage_for_transfer(named, device, staging_bytes)
        results.put("staged")
        results.put(sender.send_weights(staged))
        del staged
    sender.close()


async def measure_engines(args: argparse.Namespace, where: Placement) -> dict[str, dict]:
    """One engine, streaming --inflight requests, synced by each backend in turn (the baseline's first)."""
    from asyncrl.config.rollout import SamplingConfig
    from rollout_servers.engine import RolloutEngine

    config = load_config(args.config, args.overrides)
    engine = await RolloutEngine.start(args.model, config.rollout)
    streaming = SamplingConfig(temperature=1.0, max_tokens=config.rollout.engine.max_model_len // 2, ignore_eos=True, n=1)
    background = [asyncio.create_task(engine.generate([1, 2, 3, 4], streaming)) for _ in range(args.inflight)]
    measured = {}
    for backend in where.backends:
        measured[backend] = await measure_engine(args, where, backend, engine, config.rollout.weight_sync.staging_bytes)
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    engine.shutdown()
    return measured


async def measure_engine(args: argparse.Namespace, where: Placement, backend: str, engine, staging_bytes: int) -> dict:
    commands, results = SPAWN.Queue(), SPAWN.Queue()
    address = GroupAddress(HOST, free_port(), world_size=2, backend=backend, timeout_s=args.timeout_s)
    held_on = where.trainer if args.trainer_weights == "device" else torch.device("cpu")
    sender = SPAWN.Process(target=trainer, args=(address, where.trainer, held_on, staging_bytes, args.model, args.dtype,
                                                 commands, results))
    sender.start()
    update_info = await asyncio.to_thread(results.get, True, WAIT_S)
    handle = await asyncio.to_thread(results.get, True, WAIT_S) if backend == IPC else None
    await engine.join_weight_sync(init_info_for(address, RECEIVER_RANK, handle))
    pauses, sends = [], []
    for version in range(engine.current_version + 1, engine.current_version + args.rounds + 2):
        commands.put(version)
        await asyncio.to_thread(results.get, True, WAIT_S)  # staged: the servers are invited only now
        pauses.append(await engine.update_weights(update_info, version))
        sends.append(await asyncio.to_thread(results.get, True, WAIT_S))
    commands.put(None)
    sender.join(WAIT_S)
    return {"pause_s": pauses[1:], "send_s": sends[1:], "staging_bytes": staging_bytes}


def print_table(floor: dict | None, engines: dict[str, dict]) -> None:
    rows = []
    if floor is not None:
        rows += [("flat buffer broadcast (floor)", floor["flat_s"]), ("per-tensor broadcast (floor)", floor["per_tensor_s"])]
    for backend, engine in engines.items():
        send = "trainer copy into the shared buffer" if backend == IPC else "trainer send, engine receiving"
        rows += [(f"{backend}: {send}", engine["send_s"]), (f"{backend}: engine pause -> resume", engine["pause_s"])]
    print(f"{'measurement':44} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, seconds in rows:
        print(f"{name:44} {statistics.median(seconds) * MS:10.1f} {min(seconds) * MS:8.1f} {max(seconds) * MS:8.1f}")


def main() -> None:
    args = parse_args()
    where = placement(args.colocated)
    prepare_nccl_environment(HOST)
    floor = None if args.colocated else measure_floor(args, where)
    engines = asyncio.run(measure_engines(args, where))
    print_table(floor, engines)
    measured = engines[where.backend]
    sync_ms = statistics.median(measured["pause_s"]) * MS
    result = {
        "backend": where.backend, "weight_sync_ms": round(sync_ms, 2),
        "trainer_send_ms": round(statistics.median(measured["send_s"]) * MS, 2),
        "trainer_weights": args.trainer_weights, "staging_bytes": measured["staging_bytes"],
    }
    if floor is not None:
        floor_ms = statistics.median(floor["per_tensor_s"]) * MS
        result |= {"bytes": floor["bytes"], "tensors": floor["tensors"], "nccl_floor_ms": round(floor_ms, 2),
                   "flat_floor_ms": round(statistics.median(floor["flat_s"]) * MS, 2),
                   "sync_vs_floor": round(sync_ms / floor_ms, 2)}
    if args.colocated:
        baseline_ms = statistics.median(engines[GLOO]["pause_s"]) * MS
        result |= {"colocated_weight_sync_ms": round(sync_ms, 2), "gloo_weight_sync_ms": round(baseline_ms, 2),
                   "ipc_vs_gloo": round(baseline_ms / sync_ms, 2)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

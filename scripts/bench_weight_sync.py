"""Weight-sync wall time (pause → receive → resume) of rollout engines, next to the transfer floor.

Two measurements in one run, on the same model's tensors:
  floor        plain processes (trainer on the learner's GPU, one receiver per server GPU) in an
               `asyncrl.weight_transfer` group: every tensor broadcast one by one, as a sync sends them,
               and all bytes as one flat buffer (the collective's own floor)
  engine       `RolloutEngine`s (vLLM AsyncLLM), one process each, keeping --inflight requests going, and a
               trainer process: each round the trainer stages the weights on its device as the learner's
               coordinator does (`rollout.weight_sync.staging_bytes`), then every engine pauses in keep mode,
               receives every tensor through the vLLM plugin, and resumes; the pause-to-resume time is what
               generation loses per sync, and the round (invite to the last engine's resume) is what the
               learner waits. The trainer holds the weights on its GPU, as the learner does when they fit in
               rollout.weight_sync.staging_bytes (--trainer-weights cpu: in CPU memory, as the learner holds
               weights too large for it)
--servers 1,2,4: broadcast to that many engines at once, each size in its own group (the floor too), on one
set of engines started once. On GPU, server i takes `rollout.engine.tensor_parallel_size` GPUs from GPU
i·tp on and the trainer the GPU after the last server's (NCCL); on CPU every process is a gloo process.
--colocated: trainer and one engine share cuda:0, as a one-GPU job does. There is no NCCL floor then; the
engine is synced first through gloo (the baseline: weights through CPU memory), then through CUDA IPC (the
trainer copies each round into its shared buffer before inviting the engine, which loads from its mapping).
Each engine also times the steps of its pause (`phase_ms`, the first server's medians): pause (the core stops after
its running step and its outputs are counted), start (opening the update), load (the update's RPC: the worker
receives and loads every tensor), finish (closing it), resume, and rpc_floor, one utility round trip to the engine
core outside the pause (what each of those four RPCs costs beyond its own work); load_paths says how the first server's
worker loaded the last timed round (`rollout_servers.vllm_plugin.weight_load_paths`: tensors copied in one batch,
through vLLM's load_weights, skipped as tied aliases; None for LoRA rounds).
With `model.lora.enabled=true` among the overrides the engines serve the policy as a LoRA adapter and every round
sends an adapter of `model.lora`'s shape for the model (B random) and swaps it in (docs/weight_sync.md, "LoRA
adapters"): staged in the engine's free slot beside generation, then switched to between two engine steps, with no
pause. Its phases are adapter_stage (from the staging RPC until every worker holds the adapter) and, inside it, as
the slowest worker reports them, adapter_receive (the adapter received and copied on the device) and adapter_load
(vLLM's LoRAModel built from it and written into the free slot); then adapter_switch (the switch's call to the engine
core, round trip included). The pause of such a round is the time the switch held the engine core (what generation
lost), and RESULT adds lora_sync_ms (that median, as weight_sync_ms) and lora_round_ms (the median of
adapter_stage + adapter_switch: how long the learner's round waited for the server).
Rounds are timed after one untimed warm-up round per size. Last line: RESULT {json} with weight_sync_ms
(median pause-to-resume of the first size), nccl_floor_ms (median per-tensor floor), flat_floor_ms, the bytes
sent and, per size, broadcast_ms_by_servers (median round), pause_ms_by_servers and floor_ms_by_servers;
phase_ms (the first size's, first server's medians), load_paths; colocated, colocated_weight_sync_ms, gloo_weight_sync_ms and ipc_vs_gloo
instead of the floors.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import queue
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.config import load_config
from asyncrl.config.sections import LoraConfig
from asyncrl.config_arguments import add_config_arguments
from asyncrl.net import free_port
from asyncrl.weight_transfer import GroupAddress, TransferGroup, update_info_for, weight_backend, weights_for_transfer
from asyncrl.weight_transfer.backends import GLOO, IPC, NCCL
from asyncrl.weight_transfer.nccl_env import prepare_nccl_environment
from rollout_servers.cancelled import cancel_and_wait

SPAWN = multiprocessing.get_context("spawn")  # CUDA and vLLM both need fresh processes
HOST = "127.0.0.1"
TRAINER_RANK = 0
WAIT_S = 600  # longest wait for a child's answer: no phase may hang the benchmark
POLL_S = 1.0  # how often a wait checks that the children it waits on still live
MS = 1000


@dataclass
class Placement:
    backend: str  # what is measured: "nccl", "gloo" or "ipc"
    trainer: torch.device  # the learner's device
    server_gpus: list[list[int]]  # per server, the GPUs its engine uses ([] on CPU)
    baseline: str = ""  # a backend measured first on the same engines, for comparison ("" = none)

    @property
    def backends(self) -> list[str]:
        return [self.baseline, self.backend] if self.baseline else [self.backend]

    def receivers(self, servers: int) -> list[torch.device]:
        """The devices of the first `servers` servers' workers, in group-rank order (the floor's receivers)."""
        if not self.server_gpus[0]:
            return [torch.device("cpu")] * servers
        return [torch.device("cuda", gpu) for gpus in self.server_gpus[:servers] for gpu in gpus]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, "configs/quickstart.yaml", "config overrides, e.g. rollout.engine.dtype=bfloat16")
    parser.add_argument("--model", required=True, help="Hugging Face model directory served and sent")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the sent tensors")
    parser.add_argument("--rounds", type=int, default=5, help="timed sync rounds per measurement")
    parser.add_argument("--inflight", type=int, default=32, help="requests streaming on each engine while it syncs")
    parser.add_argument("--servers", type=_sizes, default=[1],
                        help="comma-separated numbers of servers receiving each broadcast, e.g. 1,2,4")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each rendezvous and round")
    parser.add_argument("--trainer-weights", choices=("device", "cpu"), default="device",
                        help="where the trainer holds the weights between rounds: device (its GPU), as the learner does "
                             "when they fit in rollout.weight_sync.staging_bytes; cpu, as it does otherwise")
    parser.add_argument("--colocated", action="store_true",
                        help="trainer and engine share GPU 0: measure CUDA IPC against gloo on the same engine")
    args = parser.parse_args()
    if args.colocated and args.servers != [1]:
        parser.error("--colocated measures one engine: leave --servers at 1")
    return args


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--servers takes comma-separated counts, e.g. 1,2,4; got '{text}'")
    if sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--servers: every count is at least 1; got '{text}'")
    return sizes


def placement(args: argparse.Namespace, tensor_parallel: int) -> Placement:
    servers = max(args.servers)
    if args.colocated:
        return Placement(IPC.name, torch.device("cuda", 0), [[0]], baseline=GLOO.name)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return Placement(GLOO.name, torch.device("cpu"), [[] for _ in range(servers)])
    needed = servers * tensor_parallel + 1
    if gpus < needed:
        raise SystemExit(f"{servers} servers of tensor_parallel_size {tensor_parallel} and a trainer need {needed} GPUs; "
                         f"{gpus} are visible")
    server_gpus = [list(range(i * tensor_parallel, (i + 1) * tensor_parallel)) for i in range(servers)]
    return Placement(NCCL.name, torch.device("cuda", servers * tensor_parallel), server_gpus)


def load_tensors(model_dir: str, dtype: str, device: torch.device, lora: LoraConfig) -> list[tuple[str, torch.Tensor]]:
    """What a sync sends: the model's weights, or with `lora` enabled a LoRA adapter for it as the learner sends one
    (its B random, as a trained adapter's is not zero)."""
    from transformers import AutoModelForCausalLM

    if not lora.enabled:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
        return weights_for_transfer(model)
    from learner.policy.lora import ADAPTER_NAME, adapter_tensors, add_adapters, lora_layers

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    add_adapters(model, list(model.model.layers), lora, getattr(torch, dtype))
    for layer in lora_layers(model):
        torch.nn.init.normal_(layer.lora_B[ADAPTER_NAME].weight, std=0.01)
    return [(name, tensor.detach().to(device, copy=True)) for name, tensor in adapter_tensors(model)]


# floor phase: plain processes -------------------------------------------------------------------------------

def floor_member(rank: int, address: GroupAddress, device: torch.device, model_dir: str, dtype: str, lora: LoraConfig,
                 rounds: int, results) -> None:
    prepare_nccl_environment(address.host)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensors = [tensor for _, tensor in load_tensors(model_dir, dtype, device, lora)]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
    group = weight_backend(address.backend).join(address, rank, device)
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


def measure_floor(args: argparse.Namespace, where: Placement, servers: int, lora: LoraConfig) -> dict:
    """The trainer broadcasting to one plain receiver per GPU of the first `servers` servers."""
    results = SPAWN.Queue()
    devices = [where.trainer] + where.receivers(servers)
    address = GroupAddress(HOST, free_port(), len(devices), where.backend, args.timeout_s)
    members = [SPAWN.Process(target=floor_member, args=(rank, address, device, args.model, args.dtype, lora, args.rounds,
                                                        results))
               for rank, device in enumerate(devices)]
    for process in members:
        process.start()
    floor = answer(results, *members)
    for process in members:
        process.join(WAIT_S)
    return floor


# engine phase: one process per RolloutEngine, and a trainer process ------------------------------------------

def engine_server(gpus: list[int], args: argparse.Namespace, commands, results) -> None:
    """One rollout engine, streaming --inflight requests; joins groups and takes updates as it is told."""
    if gpus:  # before CUDA starts in this process; `gpus` count within what this benchmark was let see
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = [part.strip() for part in listed.split(",")] if listed else None
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[gpu] if physical else str(gpu) for gpu in gpus)
    # lets the benchmark run `weight_load_paths` in the engine's worker (vLLM sends a function only when allowed)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    asyncio.run(_serve_engine(args, commands, results))


async def _serve_engine(args: argparse.Namespace, commands, results) -> None:
    from asyncrl.config.rollout import SamplingConfig
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.vllm_plugin import weight_load_paths

    config = load_config(args.config, args.overrides)
    engine = await RolloutEngine.start(args.model, config.rollout, lora=config.model.lora)
    lora = config.model.lora.enabled
    phases = time_update_phases(engine, lora)
    streaming = SamplingConfig(temperature=1.0, max_tokens=config.rollout.engine.max_model_len // 2, ignore_eos=True, n=1)
    background = [asyncio.create_task(_keep_generating(engine, streaming)) for _ in range(args.inflight)]
    results.put("ready")
    while (command := await asyncio.to_thread(commands.get, True, WAIT_S)) is not None:
        match command:
            case ("join", init_info):
                await engine.join_weight_sync(init_info)
                results.put("joined")
            case ("update", update_info, version):
                pause_s = await engine.update_weights(update_info, version)
                phases["rpc_floor"] = await _timed_call(engine.llm.is_sleeping)
                measured = dict(phases)  # this round's, before the next round's overwrite them
                load_paths = None if lora else (await engine.llm.collective_rpc(weight_load_paths))[0]
                results.put((pause_s, measured, load_paths))
    await cancel_and_wait(background)
    engine.shutdown()


async def _keep_generating(engine, sampling) -> None:
    """One request after another, so that every round pauses an engine that is decoding: a request's tokens run out
    (max_tokens) long before the last round, and an idle engine pauses at once (1 ms against 31 ms for 256 busy
    requests on an H100)."""
    while True:
        await engine.generate([1, 2, 3, 4], sampling)


PHASES = ("pause", "start", "load", "finish", "adapter_stage", "adapter_receive", "adapter_load", "adapter_switch",
          "resume", "rpc_floor")


def time_update_phases(engine, lora: bool) -> dict[str, float]:
    """Wrap the steps `RolloutEngine.update_weights` awaits so that each records its seconds of the latest update
    in the returned dict (the vLLM helpers through the module the engine calls them by, the RPCs on its AsyncLLM).
    With `lora` the adapter's two steps are timed too (through `ServedAdapter`'s class): adapter_stage, with the
    adapter_receive and adapter_load its workers report, and adapter_switch."""
    from rollout_servers import engine as engine_module
    from rollout_servers.adapter import ServedAdapter

    phases: dict[str, float] = {}
    compat = engine_module.vllm_compat
    for phase, name in (("pause", "pause_keeping_requests"), ("start", "start_update"), ("finish", "finish_update")):
        setattr(compat, name, _recording(getattr(compat, name), phase, phases))
    for phase, name in (("load", "update_weights"), ("resume", "resume_generation")):
        setattr(engine.llm, name, _recording(getattr(engine.llm, name), phase, phases))
    if lora:
        ServedAdapter.stage = _recording(ServedAdapter.stage, "adapter_stage", phases, answered_phases=True)
        ServedAdapter.flip = _recording(ServedAdapter.flip, "adapter_switch", phases)
    return phases


def _recording(call, phase: str, phases: dict[str, float], answered_phases: bool = False):
    """`call`, recording its seconds as `phase`; with `answered_phases`, also the phases its answer names (a dict of
    seconds: the adapter's staging answers the slowest worker's)."""
    @functools.wraps(call)
    async def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            answer = await call(*args, **kwargs)
        finally:
            phases[phase] = time.perf_counter() - started
        if answered_phases:
            phases.update(answer)
        return answer

    return run


async def _timed_call(call) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


def trainer(device: torch.device, held_on: torch.device, staging_bytes: int, model_dir: str, dtype: str,
            lora: LoraConfig, commands, results) -> None:
    """Drives the sending end of each backend it is told to open, as the learner's coordinator does: each round
    stages the weights (before the servers would be invited), says so, and sends them. With IPC the stage is the
    copy into the shared buffer and nothing is sent after it (its time is reported as the send)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    named = load_tensors(model_dir, dtype, held_on, lora)
    results.put(update_info_for(named))
    end = None
    while (command := commands.get(timeout=WAIT_S)) is not None:
        match command:
            case ("open", backend, servers, tensor_parallel, timeout_s):
                prepare_nccl_environment(HOST)
                end = weight_backend(backend).sending_end(staging_bytes)
                end.stage(named)  # IPC: the shared buffer exists once staged, and its handle goes in the init requests
                address = end.address(HOST, 0, 1 + servers * tensor_parallel, timeout_s)
                results.put([end.init_info(address, 1 + i * tensor_parallel) for i in range(servers)])
                end.connect(address)
            case "round":
                staged = end.stage(named)
                results.put("staged")
                results.put(end.send(staged))
                del staged
            case "close":
                end.close()
                end = None
                results.put("closed")


def answer(results, *watched) -> Any:
    """The next item of `results`, as soon as it comes; a child of `watched` that exited before answering ends the
    wait at once (a failed engine start, a crashed trainer) instead of after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            pass
        gone = [process for process in watched if process.exitcode is not None]
        if gone:
            try:
                return results.get_nowait()  # answered just before exiting
            except queue.Empty:
                raise RuntimeError(f"{gone[0].name} exited with {gone[0].exitcode} before answering") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {WAIT_S} s")


@dataclass
class Engines:
    """The engine processes and their queues."""
    processes: list
    commands: list
    results: list

    @classmethod
    def start(cls, args: argparse.Namespace, where: Placement) -> Engines:
        commands = [SPAWN.Queue() for _ in where.server_gpus]
        results = [SPAWN.Queue() for _ in where.server_gpus]
        processes = [SPAWN.Process(target=engine_server, args=(gpus, args, command, result))
                     for gpus, command, result in zip(where.server_gpus, commands, results)]
        for process in processes:
            process.start()
        for result in results:
            if (ready := answer(result, *processes)) != "ready":
                raise RuntimeError(f"an engine did not start: {ready}")
        return cls(processes, commands, results)

    def tell(self, commands: list) -> list:
        """One command each to the first len(commands) engines, at once; their answers."""
        for queue, command in zip(self.commands, commands):
            queue.put(command)
        return [answer(result, *self.processes) for result in self.results[:len(commands)]]

    def stop(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for process in self.processes:
            process.join(WAIT_S)


def measure_engines(args: argparse.Namespace, where: Placement, tensor_parallel: int, staging_bytes: int,
                    lora: LoraConfig) -> dict:
    """Per (backend, servers): pause-to-resume, round and trainer-send seconds of --rounds timed rounds."""
    engines = Engines.start(args, where)
    commands, results = SPAWN.Queue(), SPAWN.Queue()
    held_on = where.trainer if args.trainer_weights == "device" else torch.device("cpu")
    sender = SPAWN.Process(target=trainer, args=(where.trainer, held_on, staging_bytes, args.model, args.dtype, lora,
                                                 commands, results))
    sender.start()
    update_info = answer(results, sender)
    measured, version = {}, 0
    for backend in where.backends:
        for servers in args.servers:
            commands.put(("open", backend, servers, tensor_parallel, args.timeout_s))
            engines.tell([("join", init_info) for init_info in answer(results, sender)])
            timed = []
            for _ in range(args.rounds + 1):
                version += 1
                timed.append(timed_round(engines, servers, update_info, version, commands, results, sender))
            timed = timed[1:]  # the first round of a group is a warm-up
            measured[(backend, servers)] = {key: [round_[key] for round_ in timed] for key in timed[0]}
            commands.put("close")
            answer(results, sender)
    commands.put(None)
    sender.join(WAIT_S)
    engines.stop()
    return measured


def timed_round(engines: Engines, servers: int, update_info: dict, version: int, commands, results,
                sender) -> dict[str, Any]:
    """One sync as the learner runs it: stage, invite every server, wait for the last one's resume."""
    commands.put("round")
    answer(results, sender)  # staged: the servers are invited only now
    invited = time.perf_counter()
    answers = engines.tell([("update", update_info, version)] * servers)
    round_s = time.perf_counter() - invited
    _, first_phases, load_paths = answers[0]
    return {"pause_s": max(pause for pause, _, _ in answers), "round_s": round_s, "send_s": answer(results, sender),
            **{f"{phase}_phase_s": first_phases.get(phase, 0.0) for phase in PHASES},  # a LoRA round has no start/finish
            "load_paths": load_paths}


def print_table(floors: dict[int, dict], engines: dict) -> None:
    rows = []
    for servers, floor in floors.items():
        rows += [(f"{servers} server(s): flat buffer broadcast (floor)", floor["flat_s"]),
                 (f"{servers} server(s): per-tensor broadcast (floor)", floor["per_tensor_s"])]
    for (backend, servers), measured in engines.items():
        send = "trainer copy into the shared buffer" if backend == IPC.name else "trainer send"
        rows += [(f"{servers} server(s), {backend}: {send}", measured["send_s"]),
                 (f"{servers} server(s), {backend}: longest pause -> resume", measured["pause_s"]),
                 (f"{servers} server(s), {backend}: round (invite -> last resume)", measured["round_s"])]
        rows += [(f"{servers} server(s), {backend}: first server's {phase}", measured[f"{phase}_phase_s"])
                 for phase in PHASES]
    print(f"{'measurement':60} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, seconds in rows:
        print(f"{name:60} {statistics.median(seconds) * MS:10.1f} {min(seconds) * MS:8.1f} {max(seconds) * MS:8.1f}")
    for (backend, servers), measured in engines.items():
        print(f"{servers} server(s), {backend}: the first server's last round loaded {measured['load_paths'][-1]}")


def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * MS, 2)


def main() -> None:
    args = parse_args()
    config = load_config(args.config, args.overrides)
    tensor_parallel = config.rollout.engine.tensor_parallel_size
    where = placement(args, tensor_parallel)
    prepare_nccl_environment(HOST)
    lora = config.model.lora
    floors = {} if args.colocated else {servers: measure_floor(args, where, servers, lora) for servers in args.servers}
    engines = measure_engines(args, where, tensor_parallel, config.rollout.weight_sync.staging_bytes, lora)
    print_table(floors, engines)
    first = args.servers[0]
    measured = engines[(where.backend, first)]
    sync_ms = median_ms(measured["pause_s"])
    result = {
        "backend": where.backend, "tensor_parallel_size": tensor_parallel, "weight_sync_ms": sync_ms,
        "trainer_send_ms": median_ms(measured["send_s"]), "trainer_weights": args.trainer_weights,
        "staging_bytes": config.rollout.weight_sync.staging_bytes,
        "broadcast_ms_by_servers": {n: median_ms(engines[(where.backend, n)]["round_s"]) for n in args.servers},
        "pause_ms_by_servers": {n: median_ms(engines[(where.backend, n)]["pause_s"]) for n in args.servers},
        "phase_ms": {phase: median_ms(measured[f"{phase}_phase_s"]) for phase in PHASES},
        "load_paths": measured["load_paths"][-1],
        "lora": lora.enabled,
    }
    if lora.enabled:
        rounds_s = [stage + switch for stage, switch in zip(measured["adapter_stage_phase_s"],
                                                             measured["adapter_switch_phase_s"])]
        result |= {"lora_sync_ms": sync_ms, "lora_round_ms": median_ms(rounds_s), "lora_rank": lora.rank,
                   "lora_target_modules": list(lora.target_modules)}
    if floors:
        floor_ms = median_ms(floors[first]["per_tensor_s"])
        result |= {"bytes": floors[first]["bytes"], "tensors": floors[first]["tensors"], "nccl_floor_ms": floor_ms,
                   "flat_floor_ms": median_ms(floors[first]["flat_s"]), "sync_vs_floor": round(sync_ms / floor_ms, 2),
                   "floor_ms_by_servers": {n: median_ms(floor["per_tensor_s"]) for n, floor in floors.items()}}
    if args.colocated:
        baseline_ms = median_ms(engines[(GLOO.name, first)]["pause_s"])
        result |= {"colocated_weight_sync_ms": sync_ms, "gloo_weight_sync_ms": baseline_ms,
                   "ipc_vs_gloo": round(baseline_ms / sync_ms, 2)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

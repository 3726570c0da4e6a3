"""Throughput and ack latency of the trajectory buffer, beside raw ZeroMQ PUSH/PULL + msgpack.

Every phase sends the same groups of trajectories with 1,024 completion tokens (ids, behaviour
log-probs, token versions, loss mask) from a producer process to a receiver process:
  raw       PUSH → PULL, the receiver msgpack-unpacks each message (transport + deserialisation), once
            with the product's encoding (per-token fields as packed arrays: the baseline of the ratio)
            and once with the same fields as msgpack lists of numbers (schema 1, for reference)
  buffer    TrajectoryProducer → `asyncrl buffer`: typed check, log append, fsync per policy, ack;
            the producer keeps --window groups in flight and times each ack; the buffer process's CPU
            time over the phase gives its CPU per trajectory, and so the rate one free core would
            sustain (a figure that a loaded machine moves far less than the wall-clock rate)
  delivery  BufferConsumer drains the durable run's log in batches and decodes them fully
Frames are encoded before timing (only the record id differs), so the figures are the receiver's.
The raw and durable ingest phases run --repeats times, interleaved (order flipped each round), each
durable round into a fresh log; the headline figures are the medians over rounds, and the ratio is the
median of each round's ingest / raw (the two phases of a round ran back to back, under nearly the same
load). Delivery reads the last durable round's log; fsync=none and the lists baseline run once.
Last line: RESULT {json} (ingest figures are the durable, batched-fsync rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import msgpack
import zmq

from asyncrl.buffer_process import BufferProcess, start_buffer
from launch.commands.buffer import COMMAND_LINE
from asyncrl.messages import encode
from demo.synthetic import synthetic_group
from asyncrl.transport import BufferConsumer, TrajectoryProducer
from asyncrl.units import MS_PER_S

COMPLETION_TOKENS = 1024
RECORD_ID_WIDTH = 16
PLACEHOLDER = "X" * RECORD_ID_WIDTH
MB = 1e6
PERCENTILE_P99 = 99
PHASE_TIMEOUT_S = 300  # no phase may hang the benchmark
US_PER_S = 1e6
DELIVERY_BATCH_TRAJECTORIES = 256  # trajectories the consumer asks for per batch
SPAWN = multiprocessing.get_context("spawn")  # a forked child would inherit the parent's ZeroMQ context


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2000, help="groups sent per phase")
    parser.add_argument("--samples-per-group", type=int, default=8, help="trajectories per group (GRPO's n)")
    parser.add_argument("--window", type=int, default=8, help="unacknowledged groups a producer keeps in flight")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the raw and durable ingest phases (medians reported)")
    parser.add_argument("--dir", default=None,
                        help="where the buffer logs go; the last durable round's and the fsync=none run's are kept "
                             "afterwards (default: a temporary directory, removed)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def bench_group(samples: int):
    group = synthetic_group(PLACEHOLDER, samples=samples, completion_tokens=COMPLETION_TOKENS)
    group.group_id = "bench"  # the record id must be the only place the placeholder appears
    for trajectory in group.trajectories:
        trajectory.group_id = group.group_id
    return group


def template_frame(samples: int) -> tuple[bytes, bytes]:
    """An encoded group split around its record id, so each send only splices in a new id."""
    frame = encode(bench_group(samples))
    assert frame.count(PLACEHOLDER.encode()) == 1
    prefix, suffix = frame.split(PLACEHOLDER.encode())
    return prefix, suffix


def record_id(index: int) -> str:
    return f"{index:0{RECORD_ID_WIDTH}d}"


# ----------------------------------------------------------------------------------------------
# Producer processes


def raw_producer(address: str, payload: bytes, count: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.connect(address)
    for _ in range(count):
        socket.send(payload)
    socket.close(linger=-1)
    context.term()  # returns once every message is delivered; exiting before would drop the tail


def buffer_producer(address: str, template: tuple[bytes, bytes], count: int, window: int,
                    results: multiprocessing.Queue) -> None:
    producer = TrajectoryProducer(address, max_in_flight=window, ack_timeout_s=30, deadline_s=300)
    sent_at: dict[str, float] = {}
    latencies: list[float] = []

    def collect() -> None:
        now = time.perf_counter()
        latencies.extend(now - sent_at.pop(ack.record_id) for ack in producer.acks)
        producer.acks.clear()

    started = time.perf_counter()
    for index in range(count):
        rid = record_id(index)
        frame = template[0] + rid.encode() + template[1]
        sent_at[rid] = time.perf_counter()
        producer.submit_encoded(rid, frame)
        collect()
    while producer.in_flight:
        producer.pump()
        collect()
    results.put((time.perf_counter() - started, latencies))


# ----------------------------------------------------------------------------------------------
# Phases


def run_raw(payload: bytes, count: int) -> float:
    """Seconds for a PULL socket to receive and msgpack-unpack `count` messages."""
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.rcvtimeo = PHASE_TIMEOUT_S * MS_PER_S  # a lost message raises zmq.Again instead of hanging
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    child = SPAWN.Process(target=raw_producer, args=(f"tcp://127.0.0.1:{port}", payload, count))
    child.start()
    msgpack.unpackb(socket.recv())
    started = time.perf_counter()
    for _ in range(count - 1):
        msgpack.unpackb(socket.recv())
    elapsed = time.perf_counter() - started
    child.join()
    socket.close()
    return elapsed * count / (count - 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_buffer(directory: Path, fsync: str, template: tuple[bytes, bytes], count: int, window: int):
    """Ingest `count` groups into a fresh buffer; return (buffer process, seconds, ack latencies, its CPU s)."""
    buffer = start_buffer(COMMAND_LINE, directory, overrides=[f"buffer.fsync={fsync}"], log_path=directory / "buffer.log")
    try:
        results = SPAWN.Queue()
        child = SPAWN.Process(target=buffer_producer, args=(buffer.address, template, count, window, results))
        cpu_before = cpu_seconds(buffer.process.pid)
        child.start()
        elapsed, latencies = results.get(timeout=PHASE_TIMEOUT_S)
        cpu = cpu_seconds(buffer.process.pid) - cpu_before
        child.join()
    except BaseException:
        buffer.stop()
        raise
    return buffer, elapsed, latencies, cpu


def run_delivery(address: str, count: int) -> float:
    consumer = BufferConsumer(address, "bench")
    started = time.perf_counter()
    received = 0
    while received < count:
        if time.perf_counter() - started > PHASE_TIMEOUT_S:
            raise TimeoutError(f"delivered {received} of {count} groups within {PHASE_TIMEOUT_S}s")
        received += len(consumer.next_batch(0, max_samples=DELIVERY_BATCH_TRAJECTORIES).groups)
    return time.perf_counter() - started


def row(name: str, trajectories: int, nbytes: int, seconds: float, latencies: list[float] | None = None,
        cpu_s: float | None = None) -> dict:
    result = {"mode": name, "traj_per_s": trajectories / seconds, "mb_per_s": nbytes / seconds / MB}
    if latencies:
        cuts = statistics.quantiles(latencies, n=100)
        result["ack_p50_ms"], result["ack_p99_ms"] = cuts[49] * MS_PER_S, cuts[PERCENTILE_P99 - 1] * MS_PER_S
    if cpu_s:  # /proc counts in clock ticks (10 ms): a very short phase may read 0
        result["cpu_us_per_traj"] = cpu_s / trajectories * US_PER_S
    return with_one_core_rate(result)


def with_one_core_rate(result: dict) -> dict:
    """Add the rate one free core would sustain at the row's CPU per trajectory (when it has one)."""
    if "cpu_us_per_traj" in result:
        result["one_core_traj_per_s"] = US_PER_S / result["cpu_us_per_traj"]
    return result


COLUMNS = (("traj/s", "traj_per_s", 10, 0), ("MB/s", "mb_per_s", 9, 1), ("ack p50 ms", "ack_p50_ms", 12, 2),
           ("ack p99 ms", "ack_p99_ms", 12, 2), ("CPU us/traj", "cpu_us_per_traj", 13, 1),
           ("1-core traj/s", "one_core_traj_per_s", 15, 0))  # header, key, width, decimals


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':<34}" + "".join(f"{header:>{width}}" for header, _, width, _ in COLUMNS))
    for r in rows:
        cells = (f"{r[key]:>{width}.{decimals}f}" if key in r else f"{'-':>{width}}"
                 for _, key, width, decimals in COLUMNS)
        print(f"{r['mode']:<34}" + "".join(cells))


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_buffer_") as scratch:  # ~0.5 GB of logs per run
        report(args, Path(args.dir or scratch))


RAW_MODE, BATCH_MODE = "raw zmq push/pull + msgpack", "buffer ingest, fsync=batch"


def ingest_rounds(args: argparse.Namespace, root: Path, template: tuple[bytes, bytes], raw_payload: bytes,
                  trajectories: int, nbytes: int) -> tuple[list[dict[str, dict]], BufferProcess]:
    """`--repeats` rounds of raw and durable ingest, order flipped each round; the last round's buffer is
    returned still running (delivery reads its log)."""
    rounds: list[dict[str, dict]] = []
    durable: BufferProcess | None = None
    try:
        for index in range(args.repeats):
            if durable is not None:  # an earlier round's log is not read again: free its disk and page cache
                durable.stop()
                shutil.rmtree(root / f"batch{index - 1}")
                durable = None
            phases: dict[str, dict] = {}
            for mode in ("raw", "batch") if index % 2 == 0 else ("batch", "raw"):
                if mode == "raw":
                    phases[mode] = row(RAW_MODE, trajectories, nbytes, run_raw(raw_payload, args.groups))
                else:
                    durable, seconds, latencies, cpu = run_buffer(root / f"batch{index}", "batch", template,
                                                                  args.groups, args.window)
                    phases[mode] = row(BATCH_MODE, trajectories, nbytes, seconds, latencies, cpu)
            rounds.append(phases)
    except BaseException:
        if durable is not None:
            durable.stop()
        raise
    assert durable is not None  # parse_args asks for at least one round
    return rounds, durable


def round_ratio(phases: dict[str, dict]) -> float:
    """Durable ingest over raw ZeroMQ within one round (its two phases ran back to back)."""
    return phases["batch"]["traj_per_s"] / phases["raw"]["traj_per_s"]


def median_row(name: str, rows: list[dict]) -> dict:
    """Each figure's median over `rows` (figures a row lacks, e.g. CPU of a too-short phase, are left out)."""
    keys = [key for key in rows[0] if key not in ("mode", "one_core_traj_per_s") and all(key in r for r in rows)]
    return with_one_core_rate({"mode": name, **{key: statistics.median(r[key] for r in rows) for key in keys}})


def print_rounds(rounds: list[dict[str, dict]]) -> None:
    print(f"{'round':<7}{'raw traj/s':>12}{'ingest traj/s':>15}{'ratio':>8}{'ack p50 ms':>12}{'ack p99 ms':>12}"
          f"{'CPU us/traj':>13}")
    for index, phases in enumerate(rounds, start=1):
        raw, batch = phases["raw"], phases["batch"]
        cpu = f"{batch['cpu_us_per_traj']:>13.1f}" if "cpu_us_per_traj" in batch else f"{'-':>13}"
        print(f"{index:<7}{raw['traj_per_s']:>12.0f}{batch['traj_per_s']:>15.0f}"
              f"{round_ratio(phases):>8.2f}{batch['ack_p50_ms']:>12.2f}{batch['ack_p99_ms']:>12.2f}"
              + cpu)


def report(args: argparse.Namespace, root: Path) -> None:
    """Run every phase with its logs under `root`; print the tables and the RESULT line."""
    template = template_frame(args.samples_per_group)
    frame_bytes = len(template[0]) + RECORD_ID_WIDTH + len(template[1])
    trajectories, nbytes = args.groups * args.samples_per_group, args.groups * frame_bytes
    raw_payload = template[0] + record_id(0).encode() + template[1]
    lists_payload = msgpack.packb(dataclasses.asdict(bench_group(args.samples_per_group)))

    rounds, durable = ingest_rounds(args, root, template, raw_payload, trajectories, nbytes)
    try:
        delivery_seconds = run_delivery(durable.address, args.groups)
    finally:
        durable.stop()
    ratios = [round_ratio(phases) for phases in rounds]
    rows = {"raw": median_row(RAW_MODE, [phases["raw"] for phases in rounds]),
            "raw_lists": row("raw, per-token msgpack lists (v1)", trajectories, len(lists_payload) * args.groups,
                             run_raw(lists_payload, args.groups)),
            "batch": median_row(BATCH_MODE, [phases["batch"] for phases in rounds]),
            "delivery": row("buffer delivery (consumer decodes)", trajectories, nbytes, delivery_seconds)}
    volatile, seconds, latencies, cpu = run_buffer(root / "none", "none", template, args.groups, args.window)
    volatile.stop()
    rows["none"] = row("buffer ingest, fsync=none", trajectories, nbytes, seconds, latencies, cpu)

    print(f"{args.groups} groups x {args.samples_per_group} trajectories x {COMPLETION_TOKENS} completion tokens "
          f"({frame_bytes / 1e3:.0f} kB per group; {len(lists_payload) / 1e3:.0f} kB as lists), window {args.window}")
    print_rounds(rounds)
    print(f"medians over {args.repeats} round(s) for raw and fsync=batch; one run each for the other rows:")
    print_table(list(rows.values()))
    durable_row, raw_row = rows["batch"], rows["raw"]
    print("RESULT " + json.dumps({
        "ingest_traj_per_s": round(durable_row["traj_per_s"]),
        "ingest_mb_per_s": round(durable_row["mb_per_s"], 1),
        "ack_p50_ms": round(durable_row["ack_p50_ms"], 2),
        "ack_p99_ms": round(durable_row["ack_p99_ms"], 2),
        "delivery_traj_per_s": round(rows["delivery"]["traj_per_s"]),
        "ingest_nofsync_traj_per_s": round(rows["none"]["traj_per_s"]),
        "buffer_nofsync_cpu_us_per_traj": round(rows["none"].get("cpu_us_per_traj", 0), 1) or None,
        "raw_zmq_traj_per_s": round(raw_row["traj_per_s"]),
        "raw_zmq_lists_traj_per_s": round(rows["raw_lists"]["traj_per_s"]),
        "ingest_vs_raw": round(statistics.median(ratios), 2),
        "ingest_vs_raw_min": round(min(ratios), 2),
        "ingest_vs_raw_max": round(max(ratios), 2),
        "buffer_cpu_us_per_traj": round(durable_row.get("cpu_us_per_traj", 0), 1) or None,
        "buffer_one_core_traj_per_s": round(durable_row.get("one_core_traj_per_s", 0)) or None,
        "samples_per_group": args.samples_per_group,
        "window": args.window,
        "repeats": args.repeats,
    }))


if __name__ == "__main__":
    main()

"""The `asyncrl` command line. Parsing imports nothing heavy: each subcommand's module (and torch,
vLLM, the role packages) is imported only after the arguments are parsed, so `--help` is instant."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence

from asyncrl.config_arguments import add_config_arguments
from asyncrl.heap import exit_without_teardown
from asyncrl.parent_death import die_with_spawner_from_the_start

die_with_spawner_from_the_start()  # a process spawned below an asyncrl command imports this module first of all
exit_without_teardown()  # before the roles import their libraries, whose exit handlers must run before it


@dataclass(frozen=True)
class Flag:
    name: str  # e.g. "--num-servers"
    key: str  # config key it sets, e.g. "rollout.num_servers"
    help: str
    metavar: str = "N"  # shown in the usage line


@dataclass(frozen=True)
class Argument:
    name: str  # positional ("run_dir") or option ("--out") of one command, beside --config and the overrides
    metavar: str  # shown in the usage line, e.g. "RUN_DIR"; empty: an option that takes no value (a switch)
    help: str
    many: bool = False  # a positional that takes one or more values


@dataclass(frozen=True)
class Command:
    name: str  # subcommand as typed
    summary: str  # one line for `asyncrl --help`
    description: str  # paragraph for `asyncrl <name> --help`
    target: str  # "module:function" called with the parsed arguments
    flags: tuple[Flag, ...] = ()  # shorthands for config keys
    arguments: tuple[Argument, ...] = ()  # the command's own arguments (not config keys)
    takes_config: bool = True  # False: the command reads no config (no --config, no overrides)


COMMANDS = (
    Command(
        "data",
        "write synthetic verifiable train/val files (verl layout)",
        "Writes train and validation files for the synthetic task task.name (arithmetic, scratchpad, or the "
        "multi-turn calculator and guess_number) in verl's layout (prompt as a chat list, data_source, "
        "ability, reward_model.ground_truth, extra_info) under task.out_dir. Difficulty: "
        "task.min_digits/max_digits and task.operators, task.scratchpad.*, task.guess_number.*. "
        "Deterministic for run.seed.",
        "launch.commands.data:main",
    ),
    Command(
        "init-model",
        "build the tiny default model and tokenizer locally, then warm-start it",
        "Builds a Qwen2-architecture causal LM (shape under model.tiny) with a character-level "
        "tokenizer and chat template, or Qwen3's real tokenizer fetched at setup (model.tiny.tokenizer=qwen3), "
        "with nothing downloaded, and warm-starts it with a short "
        "supervised phase (model.warm_start) on the synthetic task (teacher episodes for multi-turn "
        "tasks). Saves a Hugging Face directory at "
        "model.path that transformers and vLLM load, and records the starting accuracy in "
        "init_report.json there. Cached: a second call with the same config returns at once.",
        "launch.commands.init_model:main",
    ),
    Command(
        "run",
        "run the whole job here: buffer, learner and rollout servers, with live progress",
        "Starts the learner (which starts the buffer) and the rollout servers on this machine, prints a "
        "progress line per step (reward, staleness, loss, weight-sync time, tokens/s), writes the run "
        "directory (config.yaml, metrics.jsonl, checkpoints/, logs/ per role) and stops every process "
        "on Ctrl-C or SIGTERM. Its last line is `RUN_DIR <path>`.",
        "launch.commands.run:main",
        (Flag("--num-servers", "rollout.num_servers", "rollout server processes (one vLLM engine each)"),),
    ),
    Command(
        "launch",
        "run the whole job on a Ray cluster: buffer, learner ranks and rollout servers as actors",
        "Joins the Ray cluster at ray.address (auto: the one `ray start` runs on this node), reserves "
        "each role's CPUs, GPUs and custom resources (ray.buffer / ray.learner / ray.rollout) with placement "
        "groups, starts the buffer, learner.nproc learner ranks and rollout.num_servers rollout servers as "
        "actors, wires their addresses (the buffer binds its node's address with CURVE keys), streams every "
        "role's output here with the role as prefix, restarts rollout servers and the buffer when they die, "
        "fails the run when a learner rank dies, and stops every role on exit, Ctrl-C or SIGTERM. Every node "
        "needs asyncrl installed and the driver's working directory (model, data, run directory) at the same "
        "path. Its last line is `RUN_DIR <path>`. See docs/ray.md.",
        "launch.commands.launch:main",
        (Flag("--ray-address", "ray.address", "Ray cluster: auto, host:port or ray://host:port", "ADDRESS"),
         Flag("--num-servers", "rollout.num_servers", "rollout servers (one vLLM engine each)")),
    ),
    Command(
        "learner",
        "train: FSDP2 ranks consuming the buffer, broadcasting weights every learner.sync_every steps",
        "Spawns learner.nproc local ranks (or joins the world under torchrun), starts a buffer unless "
        "buffer.address names a running one, and writes endpoints.json into the run directory so that "
        "`asyncrl rollout` with the same run.name finds it. Checkpoints every learner.checkpoint_every "
        "steps; learner.resume=auto continues a killed run. With learner.mode=synchronous it runs the synchronous "
        "reference instead: each of learner.nproc processes (one per GPU) owning a vLLM engine and its rank of "
        "the policy (generate, train one step, load the new weights, repeat), with no buffer and no rollout servers.",
        "launch.commands.learner:main",
    ),
    Command(
        "rollout",
        "serve: N vLLM rollout servers generating into the buffer, restarted when they die",
        "Starts rollout.num_servers server processes, each owning one vLLM engine, for the learner of "
        "run.name (found through its endpoints.json) or for buffer.address + "
        "rollout.weight_sync.control_address. Servers generate as buffer admission allows, tag every "
        "token with its policy version and take weight updates in flight.",
        "launch.commands.rollout:main",
        (Flag("--num-servers", "rollout.num_servers", "rollout server processes (one vLLM engine each)"),),
    ),
    Command(
        "buffer",
        "run the trajectory buffer service (durable log, staleness, admission)",
        "Runs the ZeroMQ trajectory buffer alone, e.g. on its own node: rollout servers send trajectory "
        "groups (acknowledged once appended to the log under buffer.dir, fsync per buffer.fsync), the "
        "learner takes batches within buffer.max_staleness and commits offsets with its checkpoint, and "
        "rollout servers ask for admission. Binds buffer.bind_host:buffer.port (port 0 = a free port, "
        "written to <buffer.dir>/endpoint); a non-loopback host needs buffer.curve_dir (asyncrl keygen). "
        "Restarting on the same buffer.dir resumes from the committed offset. Stops on SIGTERM/Ctrl-C.",
        "launch.commands.buffer:main",
    ),
    Command(
        "keygen",
        "write ZeroMQ CURVE keys for the buffer, the weight-sync channel and their clients",
        "Writes a server and a client CURVE certificate pair into buffer.curve_dir and authorises the "
        "client key (authorized_clients/). Copy the directory to every host; with buffer.curve_dir set, "
        "the buffer and the weight-sync control channel encrypt and authenticate every connection and may "
        "bind a non-loopback host.",
        "launch.commands.keygen:main",
    ),
    Command(
        "export",
        "write a run's checkpoint as a Hugging Face directory (safetensors, config, tokenizer)",
        "Loads the newest complete checkpoint of RUN_DIR (or --checkpoint) into the model at the run's "
        "model.path (from RUN_DIR/config.yaml; overrides apply) and writes a directory that "
        "transformers and vLLM load, to RUN_DIR/export/step_N (or --out). A LoRA run (model.lora.enabled) "
        "writes its adapter in PEFT's layout there, and with --merged also the base with the adapter merged "
        "in, under merged/. Runs in one process with no process group, on the CPU. Its last line is "
        "`EXPORT_DIR <path>`.",
        "launch.commands.export:main",
        arguments=(
            Argument("run_dir", "RUN_DIR", "run directory written by `asyncrl run` or `asyncrl learner`"),
            Argument("--checkpoint", "PATH", "checkpoint directory to export (default: the newest complete one)"),
            Argument("--out", "DIR", "output directory (default: RUN_DIR/export/step_N)"),
            Argument("--merged", "", "LoRA run: also write the base with the adapter merged in, as a Hugging Face "
                                     "directory under merged/ in the output directory"),
        ),
    ),
    Command(
        "evaluate",
        "score the weight snapshots of finished jobs (validation.after_run) on their held-out prompts",
        "Scores every snapshot under RUN_DIR/snapshots (the versions validation was due on, kept by a job run with "
        "validation.after_run=true) on the run's held-out prompts, with the run's validation settings and seeds, "
        "on one vLLM engine of its own, after the job: the passes are on no job's clock and take no engine from "
        "generation. Several RUN_DIRs (the same model and engine settings) share the engine: one evaluator for "
        "the runs compared. Writes RUN_DIR/evaluation.jsonl, one line per version: its val/* metrics and "
        "made_at, the Unix time the learner made that version. Versions already scored are skipped, so a run "
        "still going can be evaluated again. Each snapshot holds the whole model (a version every "
        "validation.every): --drop-scored frees its disk as soon as it is scored. See docs/metrics.md.",
        "launch.commands.evaluate:main",
        arguments=(Argument("run_dirs", "RUN_DIR", "run directories written with validation.after_run=true",
                            many=True),
                   Argument("--engines", "N", "engines scoring side by side (default 1), dealt out over the visible "
                                              "GPUs, each taking the next snapshot whenever it is free, each on "
                                              "its part of its GPU's memory: the engines on a GPU together hold "
                                              "what one alone would (rollout.engine.gpu_memory_utilization)"),
                   Argument("--drop-scored", "", "delete each snapshot's weights once its score is written (the "
                                                 "index and evaluation.jsonl stay): the disk then holds only the "
                                                 "snapshots not scored yet")),
        takes_config=False,
    ),
    Command(
        "plot",
        "render a run's metrics as PNG plots under RUN_DIR/plots/",
        "Reads RUN_DIR/metrics.jsonl and writes reward.png (train and validation reward, pass@k), "
        "staleness.png, importance_weights.png (rollout_corr/*), throughput.png (tokens/s of rollout "
        "servers and learner, buffer ingest) and weight_sync.png into RUN_DIR/plots/. Metrics the run "
        "did not log are left out and listed; works on a run that is still going.",
        "launch.commands.plot:main",
        arguments=(Argument("run_dir", "RUN_DIR", "run directory (holds metrics.jsonl)"),),
        takes_config=False,
    ),
    Command(
        "tune",
        "read a finished run's metrics: generation-, learner- or sync-bound, what K, servers, micro-batch and GPU split to try",
        "Reads RUN_DIR/metrics.jsonl and RUN_DIR/config.yaml and prints, over the steps after the first tenth "
        "(warm-up), the share of the learner's time per step spent waiting for batches, in weight sync and "
        "training. Its first line is the verdict: generation-bound (the learner waited more than 10% of the "
        "time), sync-bound (weight sync took more than 25% and more than the waiting) or learner-bound, with the "
        "staleness trained, the bound K and the drift (rollout_corr/mismatch_kl, is_clip_frac). Then one line "
        "each for buffer.max_staleness (or learner.sync_every when sync-bound), rollout.num_servers and "
        "learner.micro_batch_tokens, with the numbers behind the advice. On GPUs it then predicts, from the rate a "
        "rollout server generated while busy and the rate a learner rank trained, which split of the run's GPUs (or "
        "--gpus G) between servers and learner ranks keeps both busy, with a table of every split. See "
        "docs/tuning.md.",
        "launch.commands.tune:main",
        arguments=(Argument("run_dir", "RUN_DIR", "run directory of a finished (or running) job: metrics.jsonl and config.yaml"),
                   Argument("--gpus", "G", "predict the GPU split for a host of G GPUs (default: the GPUs the run used)")),
        takes_config=False,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous RL post-training for LLMs: vLLM rollout servers generate without "
        "pause into a ZeroMQ trajectory buffer; an FSDP2 learner trains with importance-corrected PPO "
        "and broadcasts weights back every N steps.",
        epilog="Every command but plot and tune takes --config FILE plus key=value overrides; see docs/configuration.md.",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subcommands.add_parser(command.name, help=command.summary, description=command.description)
        for argument in command.arguments:
            if argument.metavar:
                sub.add_argument(argument.name, metavar=argument.metavar, help=argument.help,
                                 nargs="+" if argument.many else None)
            else:
                sub.add_argument(argument.name, action="store_true", help=argument.help)
        if command.takes_config:
            add_config_arguments(sub)
        else:
            sub.set_defaults(config=None, overrides=[])
        for flag in command.flags:
            sub.add_argument(flag.name, dest=f"flag:{flag.key}", metavar=flag.metavar, help=f"{flag.help} (sets {flag.key})")
        sub.set_defaults(target=command.target)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's namespace. KEY=VALUE overrides may also follow a command's options (argparse alone
    takes them only before, e.g. not in `export RUN_DIR --out DIR model.dtype=bfloat16`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    takes_config = next(command.takes_config for command in COMMANDS if command.name == args.command)
    if extra and (not takes_config or any(value.startswith("-") or "=" not in value for value in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides += extra
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrl.parent_death import die_with_launcher

    die_with_launcher()  # started by `asyncrl run` or a learner: this command must not outlive it
    args = parse(argv)
    args.overrides += [f"{name[5:]}={value}" for name, value in vars(args).items() if name.startswith("flag:") and value is not None]
    module_name, function_name = args.target.split(":")
    from asyncrl.config import ConfigError
    from asyncrl.exit_codes import INTERRUPTED

    try:
        return int(getattr(importlib.import_module(module_name), function_name)(args) or 0)
    except ConfigError as error:
        print(f"asyncrl {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"asyncrl {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

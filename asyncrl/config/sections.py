"""The structured config sections shared by every command. One dataclass per section.

Each field carries a one-line comment: unit and effect. Ranges and choices declared with `bounded` /
`one_of` are checked by the loader, which names the offending key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.fields import bounded, items, one_of
from asyncrl.config.task_weights import TaskWeightsConfig


@dataclass
class RunConfig:
    root_dir: str = "runs"  # directory under which each run gets its own run directory
    name: str = ""  # run name; empty = "<command>-<timestamp>"
    seed: int = bounded(0, 0)  # global seed: data order, sampling, initialisation
    log_level: str = one_of("INFO", "DEBUG", "WARNING", "ERROR")  # logging level of every role
    gpu_memory_gib: float = bounded(0.0, 0.0)  # GiB of each GPU the job may use, its roles together (0 = the whole card): rollout servers take their rollout.engine.gpu_memory_utilization of it, a learner beside them the rest, its allocator held there (docs/placement.md); no effect on CPU
    mps: str = one_of("off", "auto", "on")  # `asyncrl run`: CUDA MPS, so that the learner's and a server's kernels on a shared GPU run at once instead of in time slices: auto = when an async job's learner and servers share one GPU and nvidia-cuda-mps-control is installed; on = always, failing the run where MPS cannot start; docs/placement.md


@dataclass
class TinyModelConfig:
    hidden_size: int = bounded(256, 8)  # width of the residual stream
    num_layers: int = bounded(4, 1)  # transformer blocks
    num_heads: int = bounded(4, 1)  # attention heads (hidden_size must divide evenly)
    num_kv_heads: int = bounded(2, 1)  # key/value heads (grouped-query attention)
    intermediate_size: int = bounded(768, 8)  # MLP width
    max_position: int = bounded(256, 16)  # longest sequence the model supports, in tokens
    tie_word_embeddings: bool = True  # share input embedding and output head, as small Qwen2 models do
    vocab_size: int = bounded(0, 0)  # embedding rows; 0 = the tokenizer's size (more mimics a real model's head)
    tokenizer: str = one_of("char", "qwen3")  # vocabulary: char (~100 tokens, one per character; fast on CPU) or qwen3 (Qwen3's 151,669-token BPE, special tokens and chat template, fetched at setup; its output head makes CPU steps several times slower)


@dataclass
class WarmStartConfig:
    steps: int = bounded(400, 0)  # supervised steps on the synthetic task before RL (0 = random model)
    batch_size: int = bounded(64, 1)  # sequences per supervised step
    lr: float = bounded(3e-3, 0.0, 1.0)  # peak AdamW learning rate (linear warm-up, cosine decay)
    warmup_steps: int = bounded(20, 0)  # linear warm-up steps
    label_noise: float = bounded(0.0, 0.0, 1.0)  # chance that each answer digit shown (scratchpad: each column's sum digit) is a random digit (a sloppy teacher: sampling errs, greedy mostly not)
    eval_samples: int = bounded(128, 0)  # held-out prompts greedily decoded to record the accuracy before and after the warm start (0: no greedy pass, none recorded)
    micro_batches: int = bounded(1, 1)  # passes per step over the batch sorted by length, each padded to its own longest: the same gradient, less padding where lengths are long-tailed
    device: str = one_of("cpu", "cuda")  # where init-model builds and trains the model; cuda: the first visible GPU, passes in bf16 autocast
    deterministic: bool = False  # on a GPU: torch's deterministic algorithms, strictly (an op without one stops the warm start, named), and cuBLAS's deterministic workspace, so that another host of the same GPU and software can make the same weights (weights_sha256); slower. The CPU warm start is deterministic as it is


LORA_MAX_RANK = 512  # the largest adapter rank vLLM serves (its max_lora_rank)
DECODER_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Qwen2 / Llama names


@dataclass
class LoraConfig:
    enabled: bool = False  # train low-rank adapters on a frozen base instead of every weight; the servers serve the policy as an adapter
    rank: int = bounded(16, 1, LORA_MAX_RANK)  # r: inner width of each adapter (A is r x in, B is out x r); at most the smaller side of every adapted layer
    alpha: float = bounded(32.0, 0.0)  # the adapter's output is scaled by alpha / rank
    dropout: float = bounded(0.0, 0.0, 0.99)  # dropout on the adapters' input in training passes only (scoring, the servers and the reference see none)
    target_modules: list[str] = items(*DECODER_LINEAR_LAYERS)  # linear layers of the decoder layers that get adapters, by the last part of their name

    def cross_checks(self) -> list[tuple[str, str]]:
        if self.enabled and not self.target_modules:
            return [("model.lora.target_modules", "needs at least one layer name when model.lora.enabled")]
        return []

    def peft_fields(self) -> dict[str, Any]:
        """The adapter's settings under PEFT's `LoraConfig` names (what `adapter_config.json` holds)."""
        return {"r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": list(self.target_modules), "bias": "none"}


@dataclass
class ModelConfig:
    path: str = ".cache/models/tiny"  # Hugging Face directory (or hub id on machines with a hub)
    dtype: str = one_of("float32", "bfloat16", "float16")  # weights as built by init-model, written by export and sent to the servers (the learner keeps learner.master_dtype)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # shape of the locally built model
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)  # supervised phase of init-model
    lora: LoraConfig = field(default_factory=LoraConfig)  # train LoRA adapters instead of the whole model (docs/learner.md)


@dataclass
class CalculatorTaskConfig:
    tool_use_rate: float = bounded(0.5, 0.0, 1.0)  # warm-start teacher: share of episodes that call the calculator; the rest answer unaided (mostly wrong)
    tool_format: str = one_of("calc", "hermes")  # calc: the model writes <calc>EXPR</calc>; hermes: a function tool "calc" listed by the chat template, called as <tool_call>{...}</tool_call> (needs environment.tool_parser=hermes)


@dataclass
class GuessNumberTaskConfig:
    max_number: int = bounded(20, 2)  # the hidden number is drawn uniformly from 1..max_number
    max_guesses: int = bounded(6, 1)  # guesses per episode (written into each row's extra_info)
    bisect_rate: float = bounded(0.3, 0.0, 1.0)  # warm-start teacher: share of guesses at the middle of the range left; the rest anywhere in it
    reward: str = one_of("fewer_guesses", "solved")  # fewer_guesses: 1 − (guesses − 1)/max_guesses when found; solved: 1 when found (in each row's extra_info)
    feedback: str = one_of("direction", "range")  # after a wrong guess: "higher"/"lower"; range: also the numbers still possible, "higher: 17-31"


# The scratchpad task's worked solution (demo/tasks/scratchpad.py), counted in the tiny model's character tokens:
SCRATCHPAD_COLUMN_TOKENS = 8  # a line's column sum "7+8+0=15": two digits, the carry in, carry out and sum digit, 3 signs
SCRATCHPAD_LINE_MARKS = 4  # a line's other characters: '+' between the restated operands, two ':', the newline
CHAT_PROMPT_TOKENS = 19  # the tiny tokenizer's ChatML around one user message plus the assistant header
END_OF_TURN_TOKENS = 1  # the end-of-turn token after a response


@dataclass
class ScratchpadTaskConfig:
    min_size: int = bounded(1, 1)  # fewest digits per operand (a 1-digit problem's worked solution: 18-19 tokens)
    max_size: int = bounded(5, 1)  # most digits per operand; a solution takes 1.5 size² + 14.5 size + 3 tokens at most (21 digits: 969)
    tail: float = bounded(1.0, 0.0)  # training sizes are drawn with probability ∝ size^-tail: 0 = uniform, larger = long problems rarer
    val_tail: float = bounded(0.0, 0.0)  # the same for the held-out problems; 0 = every size equally often, so every length bucket gets prompts

    def longest_prompt_tokens(self) -> int:
        """Prompt tokens of a `max_size` problem ("367+398="), chat template included."""
        return CHAT_PROMPT_TOKENS + 2 * self.max_size + 2

    def longest_response_tokens(self) -> int:
        """Tokens of a `max_size` problem's worked solution with a final carry: line i (0-based, from the right)
        restates the 2 × (size − i) digits not yet added, adds a column and writes the i + 1 answer digits so
        far; then "=" and the size + 1 digits of the sum, and the end of the turn."""
        size = self.max_size
        lines = sum(2 * (size - i) + SCRATCHPAD_COLUMN_TOKENS + (i + 1) + SCRATCHPAD_LINE_MARKS for i in range(size))
        return lines + 1 + (size + 1) + END_OF_TURN_TOKENS


@dataclass
class TaskConfig:
    name: str = one_of("arithmetic", "calculator", "guess_number", "scratchpad")  # synthetic task written by `asyncrl data` and taught by the warm start
    out_dir: str = ".cache/data/arithmetic"  # where train/val files are written
    format: str = one_of("parquet", "jsonl")  # file format of the written files
    num_train: int = bounded(20000, 1)  # training prompts
    num_val: int = bounded(256, 1)  # held-out prompts
    min_digits: int = bounded(1, 1, 18)  # fewest digits per operand (difficulty, lower end)
    max_digits: int = bounded(2, 1, 18)  # most digits per operand (difficulty, upper end)
    operators: str = "+-"  # operators drawn uniformly; any of "+-*"
    calculator: CalculatorTaskConfig = field(default_factory=CalculatorTaskConfig)  # multi-turn tool use (name=calculator; questions use the digit/operator fields)
    guess_number: GuessNumberTaskConfig = field(default_factory=GuessNumberTaskConfig)  # multi-turn higher/lower game (name=guess_number)
    scratchpad: ScratchpadTaskConfig = field(default_factory=ScratchpadTaskConfig)  # long-tailed addition worked column by column (name=scratchpad; ignores the digit/operator fields)


@dataclass
class DataConfig:
    train_files: list[str] = items(".cache/data/arithmetic/train.parquet")  # training files (parquet or jsonl)
    weights: list[float] = items()  # sampling weight per training file; empty = uniform
    task_weights: TaskWeightsConfig = field(default_factory=TaskWeightsConfig)  # weights that move from stalled tasks to improving ones
    val_files: list[str] = items(".cache/data/arithmetic/val.parquet")  # held-out files for validation
    max_prompt_length: int = bounded(128, 1)  # prompts longer than this (tokens) are skipped with a warning
    shuffle: bool = True  # draw rows in a seeded random order per epoch
    skip_bad_rows: bool = False  # False: a malformed row stops the job (naming file and row); True: skip and warn


@dataclass
class CustomRewardConfig:
    path: str = ""  # Python file defining the reward function; empty = built-in scorers by data_source
    name: str = "compute_score"  # function name, verl signature (data_source, solution_str, ground_truth, extra_info)


@dataclass
class RewardTermConfig:
    data_source: str = ""  # the task whose reward this term is part of
    name: str = ""  # the term's entry in reward_info, logged as critic/<data_source>/<name>/mean and val/...
    path: str = ""  # Python file of the term's scorer (verl signature); empty = the task's own reward (custom_fn or built-in)
    function: str = "compute_score"  # function name in `path`
    weight: float = 1.0  # factor of the term in the task's reward, which is the sum of weight × term (negative: a penalty)


@dataclass
class RewardConfig:
    custom_fn: CustomRewardConfig = field(default_factory=CustomRewardConfig)  # user reward function
    terms: list[RewardTermConfig] = field(default_factory=list)  # tasks whose reward combines several scorers; others keep custom_fn / built-in
    timeout_s: float = bounded(10.0, 0.01)  # per-sample scoring deadline; past it the sample gets a failure
    num_workers: int = bounded(2, 1)  # scoring worker processes (signals in math-verify rule out threads)

    def cross_checks(self) -> list[tuple[str, str]]:
        """Each term names its task and a name of its own within the task (not `score`, the reward's own entry)."""
        problems, seen = [], set()
        for index, term in enumerate(self.terms):
            key = f"reward.terms[{index}]"
            if not term.data_source:
                problems.append((f"{key}.data_source", "must name the task (a data_source) the term belongs to"))
            if not term.name or term.name == "score":
                problems.append((f"{key}.name", "must be a non-empty name other than 'score'"))
            elif (term.data_source, term.name) in seen:
                problems.append((f"{key}.name", f"'{term.name}' is used twice for data_source '{term.data_source}'"))
            seen.add((term.data_source, term.name))
        return problems


@dataclass
class MetricsConfig:
    wandb_mode: str = one_of("auto", "online", "offline", "disabled")  # auto = online with WANDB_API_KEY, else offline
    wandb_project: str = "asyncrl"  # wandb project name
    wandb_entity: str = ""  # wandb team/user; empty = the account default

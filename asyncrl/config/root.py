"""The root config: every section in one tree, registered in hydra's ConfigStore."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.buffer import BufferConfig
from asyncrl.net import is_loopback, split_tcp_endpoint
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.guard import GuardConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.ray_launch import RayConfig
from asyncrl.config.rollout import RolloutConfig
from asyncrl.config.sections import DataConfig, MetricsConfig, ModelConfig, RewardConfig, RunConfig, TaskConfig
from asyncrl.config.validation import ValidationConfig


@dataclass
class AsyncRLConfig:
    run: RunConfig = field(default_factory=RunConfig)  # run directory, seed, logging
    model: ModelConfig = field(default_factory=ModelConfig)  # policy model and the tiny default
    task: TaskConfig = field(default_factory=TaskConfig)  # synthetic data generator
    data: DataConfig = field(default_factory=DataConfig)  # training/validation files and mixing
    reward: RewardConfig = field(default_factory=RewardConfig)  # scoring of completions
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # metrics.jsonl and wandb
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # policy loss, advantages, clip / IS / KL settings
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # training loop, optimizer, checkpoints, sync cadence
    buffer: BufferConfig = field(default_factory=BufferConfig)  # trajectory buffer service and its clients
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # vLLM rollout servers, sampling, weight sync
    validation: ValidationConfig = field(default_factory=ValidationConfig)  # periodic held-out evaluation (val/* metrics)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  # multi-turn episodes: environments by data source, limits
    ray: RayConfig = field(default_factory=RayConfig)  # `asyncrl launch`: placement of the roles on a Ray cluster
    guard: GuardConfig = field(default_factory=GuardConfig)  # rollback of the learner when a watched metric collapses

    def cross_checks(self) -> list[tuple[str, str]]:
        """Constraints spanning several fields, as (key, problem) pairs."""
        problems = []
        tiny = self.model.tiny
        if tiny.hidden_size % tiny.num_heads:
            problems.append(("model.tiny.num_heads", f"must divide hidden_size={tiny.hidden_size}"))
        if tiny.num_heads % tiny.num_kv_heads:
            problems.append(("model.tiny.num_kv_heads", f"must divide num_heads={tiny.num_heads}"))
        if self.task.min_digits > self.task.max_digits:
            problems.append(("task.min_digits", f"must not exceed task.max_digits={self.task.max_digits}"))
        if set(self.task.operators) - set("+-*") or not self.task.operators:
            problems.append(("task.operators", "must be a non-empty combination of '+', '-', '*'"))
        if self.data.weights and len(self.data.weights) != len(self.data.train_files):
            problems.append(("data.weights", f"needs one weight per train file ({len(self.data.train_files)})"))
        if any(w < 0 for w in self.data.weights) or (self.data.weights and sum(self.data.weights) <= 0):
            problems.append(("data.weights", "must be non-negative with a positive sum"))
        if not self.data.train_files:
            problems.append(("data.train_files", "needs at least one file"))
        if self.validation.every and self.validation.k > self.validation.n:
            problems.append(("validation.k", f"must not exceed validation.n={self.validation.n} (samples per prompt)"))
        if self.validation.every and not self.data.val_files:
            problems.append(("data.val_files", "needs at least one file when validation.every > 0"))
        if self.validation.after_run and self.learner.mode != "synchronous" and self.validation.every % self.learner.sync_every:
            problems.append(("validation.after_run", f"needs validation.every={self.validation.every} to be a multiple "
                             f"of learner.sync_every={self.learner.sync_every}: the learner gathers whole weights "
                             "only when it sends them"))
        chat = self.rollout.chat
        if chat.enabled and chat.session_idle_s >= self.learner.batch_timeout_s:
            problems.append(("rollout.chat.session_idle_s",
                             f"must be below learner.batch_timeout_s={self.learner.batch_timeout_s:g}: sessions an "
                             "agent abandoned hold admission places until dropped, and the learner may wait for "
                             "those places that long"))
        synchronous = self.learner.mode == "synchronous"
        if synchronous:
            problems += self._synchronous_problems()
        problems += self.data.task_weights.cross_checks(len(self.data.train_files), self.data.weights, synchronous) + self.reward.cross_checks()
        problems += self.guard.cross_checks(self.learner.checkpoint_every, self.learner.keep_checkpoints, synchronous)
        problems += self._study_lag_problems() + self.algorithm.cross_checks(self.buffer.batch_groups)
        problems += chat.cross_checks() + self.environment.cross_checks(self.rollout.engine.max_model_len)
        problems += self.rollout.engine.cross_checks()
        problems += (self._control_channel_problems() + self._scratchpad_fit_problems() + self.validation.cross_checks()
                     + self.model.lora.cross_checks())
        return problems + self.learner.cross_checks() + self.buffer.cross_checks() + self.ray.cross_checks(self.rollout.engine.tensor_parallel_size)

    def _synchronous_problems(self) -> list[tuple[str, str]]:
        """learner.mode=synchronous: one engine per learner rank, each rank beside its own when there are several."""
        ranks = self.learner.nproc
        problems = []
        if self.rollout.num_servers != 1:
            problems.append(("rollout.num_servers", "learner.mode=synchronous runs one engine in each learner rank: "
                                                    "must be 1"))
        if self.buffer.batch_groups < ranks:
            problems.append(("buffer.batch_groups", f"must be at least learner.nproc={ranks} with "
                             "learner.mode=synchronous: each rank samples its share of a step's prompts"))
        if ranks > 1 and self.rollout.engine.tensor_parallel_size != 1:
            problems.append(("rollout.engine.tensor_parallel_size", f"must be 1 with learner.mode=synchronous and "
                             f"learner.nproc={ranks}: each rank's engine runs on the rank's one GPU"))
        if ranks > 1 and self.rollout.placement == "apart":
            problems.append(("rollout.placement", f"learner.mode=synchronous with learner.nproc={ranks} runs each "
                             "rank's engine beside it on its GPU: set auto or shared"))
        return problems

    def _study_lag_problems(self) -> list[tuple[str, str]]:
        """buffer.study_lag_versions holds the lag exact only where the async learner broadcasts every step."""
        if not self.buffer.study_lag_versions:
            return []
        key = "buffer.study_lag_versions"
        if self.learner.mode == "synchronous":
            return [(key, "learner.mode=synchronous samples with the newest weights by construction: it has no lag to set")]
        if self.learner.sync_every != 1:
            return [(key, f"needs learner.sync_every=1 (is {self.learner.sync_every}): between broadcasts the servers' "
                          "weights would fall further behind than the lag")]
        return []

    def _scratchpad_fit_problems(self) -> list[tuple[str, str]]:
        """The largest scratchpad problem's prompt and worked solution fit every limit they pass through: else the
        longest problems would be skipped or cut short, and never rewarded."""
        if self.task.name != "scratchpad":
            return []
        pad = self.task.scratchpad
        if pad.min_size > pad.max_size:
            return [("task.scratchpad.min_size", f"must not exceed task.scratchpad.max_size={pad.max_size}")]
        prompt, response = pad.longest_prompt_tokens(), pad.longest_response_tokens()
        limits = (("model.tiny.max_position", self.model.tiny.max_position, prompt + response, "prompt + solution"),
                  ("rollout.engine.max_model_len", self.rollout.engine.max_model_len, prompt + response, "prompt + solution"),
                  ("rollout.sampling.max_tokens", self.rollout.sampling.max_tokens, response, "solution"),
                  ("data.max_prompt_length", self.data.max_prompt_length, prompt, "prompt"))
        return [(key, f"is {have}, but the largest scratchpad problem (task.scratchpad.max_size={pad.max_size}) "
                      f"needs {need} tokens for its {what}")
                for key, have, need, what in limits if have < need]

    def _control_channel_problems(self) -> list[tuple[str, str]]:
        """The buffer's CURVE rule for the weight-sync control socket, which shares the buffer's keys."""
        key = "rollout.weight_sync.control_bind"
        try:
            host, _ = split_tcp_endpoint(self.rollout.weight_sync.control_bind)
        except ValueError as error:
            return [(key, str(error))]
        if not is_loopback(host) and not self.buffer.curve_dir:
            return [(key, f"'{host}' is not loopback: set buffer.curve_dir (asyncrl keygen), whose keys the "
                          "weight-sync control channel shares with the buffer")]
        return []


ConfigStore.instance().store(name="asyncrl", node=AsyncRLConfig)

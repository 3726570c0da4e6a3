"""One rollout server: a vLLM engine kept busy with prompt groups as buffer admission allows, each
group scored off the engine's loop and sent to the buffer (acknowledged), weights updated in flight."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from pathlib import Path

from transformers import AutoTokenizer

from asyncrl.config import AsyncRLConfig
from asyncrl.data import PromptMixture
from asyncrl.gpu_ids import visible_gpus
from rollout_servers.environments import EnvironmentRegistry
from asyncrl.heap import freeze_startup_heap
from asyncrl.messages import Ack, TrajectoryGroup
from rollout_servers.rewards import RewardScorer, check_reward_setup
from asyncrl.stop_signal import ignore_stop_signals, stop_signals_held
from asyncrl.thinking import Thinking
from asyncrl.whole_files import write_json_whole
from asyncrl.transport import AdmissionClient, TrajectoryProducer
from asyncrl.weight_transfer.control_messages import ServerTelemetry, ValidationResult
from rollout_servers.admission_asks import AdmissionAsks
from rollout_servers.cancelled import cancel_and_wait
from rollout_servers.agent_loop import AgentLoop
from rollout_servers.buffer_calls import BufferCalls
from rollout_servers.chat.admission import ChatAdmission
from rollout_servers.chat.auth import load_api_key
from rollout_servers.chat.endpoint import ChatEndpoint
from rollout_servers.chat.lost import LostSessions
from rollout_servers.chat.sessions import ChatSessions
from rollout_servers.chat.tools import ToolCallReader
from rollout_servers.engine import RolloutEngine
from rollout_servers.engine_turns import engine_start_turn
from rollout_servers.group_sampler import GroupSampler, ServerStats
from rollout_servers.learner_wait import Endpoints, LearnerWait
from rollout_servers.prompt_stream import PromptStream
from rollout_servers.sample_slots import Claim, SampleSlots
from rollout_servers.start_gate import StartGate
from rollout_servers.sync_client import SyncClient, cancel
from rollout_servers.telemetry import TelemetrySender
from rollout_servers.validation import Validator, load_validation_prompts

log = logging.getLogger(__name__)

_SERVER_SEED_STRIDE = 1_000_003  # servers draw prompts from distinct streams of the same mixture
VALIDATING_SERVER = 0  # index of the one server that runs validation passes
LEAVING_ANSWER_TIMEOUT_S = 5.0  # one send to the learner's coordinator: ample, unless the learner is gone


class RolloutServer:
    def __init__(self, config: AsyncRLConfig, server_index: int, endpoints: Endpoints,
                 state_dir: Path | None = None) -> None:
        """`state_dir` keeps the server's prompt-stream position, so a restarted server regenerates the
        prompts its previous process left unacknowledged (see `PromptStream`); None keeps it in memory."""
        self.config = config
        self.server_id = f"server-{server_index}"
        self._index = server_index
        self._state_dir = state_dir
        # Sampling seeds follow the prompt order: a rerun with the same run.seed samples the same
        # completions for the same prompts (what makes K=0 reproduce learner.mode=synchronous exactly).
        self._seed_base = config.run.seed + _SERVER_SEED_STRIDE * server_index
        self.endpoints = endpoints
        mixture = PromptMixture(
            config.data.train_files, config.data.weights, seed=self._seed_base,
            shuffle=config.data.shuffle, skip_bad_rows=config.data.skip_bad_rows,
        )
        self.prompts = PromptStream(mixture, state_dir / f"{self.server_id}.prompts.json" if state_dir else None)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.thinking = Thinking.for_tokenizer(config.rollout.thinking, self.tokenizer)  # fails before the engine starts
        self.environments = EnvironmentRegistry.from_config(config.environment.by_source)  # fails fast on a bad name
        self.stats = ServerStats()
        self.validator = self._validator(server_index)
        self._check_rewards(mixture)
        self.groups = GroupSampler(config, self.server_id, self._seed_base, self.prompts, self.tokenizer, self.stats,
                                   self.thinking)
        self._chat_places = ChatAdmission(config.rollout.sampling.n)  # chat sessions' share of admission
        self._slots = SampleSlots(config.rollout.max_inflight)
        self._asks = AdmissionAsks(self._slots, self._chat_places, config.rollout.sampling.n)
        self._chat_sessions: ChatSessions | None = None  # the endpoint's sessions, when it serves
        chat = config.rollout.chat  # its key and tool parser are read now: a bad one stops the server before its engine starts
        self._chat_key = load_api_key(chat) if chat.enabled else None
        self._chat_tools = ToolCallReader(chat.tool_parser, self.tokenizer) if chat.enabled and chat.tool_parser else None
        self._stop = asyncio.Event()
        self._started = time.perf_counter()
        self._buffer = BufferCalls(LearnerWait(endpoints.buffer, endpoints.sync, endpoints.learner_dir))
        self.finished_version: int | None = None  # the learner's final version, once it said the job is finished
        self._buffer_quiet = asyncio.Event()  # set once stopped with no request to the buffer left running
        self._leaving = False  # the learner said the job is finished: the server answers that it leaves, then stops

    async def serve(self) -> None:
        engine: RolloutEngine | None = None
        # The reward workers are spawned first and import while the engine starts: waited for after it, they took
        # seconds between the engine's start and the server's joining weight sync.
        with RewardScorer(self.config.reward, wait_ready=False) as scorer:
            try:
                # vLLM's start swallows the KeyboardInterrupt of a stop (see `stop_signals_held`) and goes on to a
                # running engine: a server stopped meanwhile would join weight sync and generate. Held, the stop is
                # acted on as the start ends, before the server reaches the learner or the buffer.
                # The GPU's start turn first: a stop while this server waits for it is acted on at once.
                with engine_start_turn(visible_gpus(), self.config.rollout.connect_timeout_s, self.server_id), \
                        stop_signals_held():
                    engine = await RolloutEngine.start(self.config.model.path, self.config.rollout, version=0,
                                                       lora=self.config.model.lora,
                                                       gpu_memory_gib=self.config.run.gpu_memory_gib,
                                                       process_is_fresh=True)
                scorer.wait_ready()
                await self._serve_with(engine, scorer)
            finally:
                if engine is not None:
                    engine.shutdown()

    async def _serve_with(self, engine: RolloutEngine, scorer: RewardScorer) -> None:
        """Generate with the started `engine` until stopped, in step with the learner's weights, scored by `scorer`."""
        rollout = self.config.rollout
        agent = AgentLoop(engine, self.tokenizer, self.environments, self.config.environment,
                          rollout.engine.max_model_len, self.thinking)
        buffer = self.config.buffer
        sync = SyncClient(self.endpoints.sync, self.server_id, engine, rollout.engine.tensor_parallel_size,
                          rollout.weight_sync.heartbeat_s, curve_dir=buffer.curve_dir,
                          on_validate=self.validator.request if self.validator else lambda version: None,
                          on_finished=self.leave, on_task_weights=self.prompts.set_weights,
                          backend=rollout.weight_sync.backend)
        telemetry = TelemetrySender(self.endpoints.sync, rollout.weight_sync.heartbeat_s, lambda: self._reports(engine),
                                    curve_dir=buffer.curve_dir)
        answering = asyncio.create_task(sync.run())  # its last act, once `leave` returns: telling the learner so
        background = [answering, asyncio.create_task(telemetry.run())]
        admission = AdmissionClient(self.endpoints.buffer, self.server_id, curve_dir=buffer.curve_dir,
                                    timeout_s=buffer.client_timeout_s, resend_s=buffer.client_resend_s)
        producer = TrajectoryProducer(self.endpoints.buffer, curve_dir=buffer.curve_dir, ack_timeout_s=buffer.client_resend_s,
                                      deadline_s=rollout.send_deadline_s)
        chat = None
        try:
            chat = await self._start_chat(engine, producer)
            validation = self._start_validation(engine, scorer, agent)
            freeze_startup_heap()  # vLLM, torch and the engine's front end: a full collection would stall the loop
            try:
                await self._generate_forever(engine, agent, admission, producer, scorer)
            finally:
                if validation is not None:
                    await cancel(validation)
        finally:
            if chat is not None:
                await chat.stop()
            await self._let_the_leaving_answer_go(answering)
            for task in background:
                await cancel(task)
            await telemetry.send_last()
            for closable in (sync, telemetry, admission, producer):
                closable.close()
            self._buffer.close()

    async def _start_chat(self, engine: RolloutEngine, producer: TrajectoryProducer) -> ChatEndpoint | None:
        """The OpenAI-compatible endpoint when `rollout.chat.enabled`; its address goes to `<server_id>.chat.json`."""
        settings, rollout = self.config.rollout.chat, self.config.rollout
        if not settings.enabled:
            return None
        open_ids = self._state_dir / f"{self.server_id}.chat_sessions.json" if self._state_dir else None
        sessions = ChatSessions(engine, self.tokenizer, rollout.engine.max_model_len, settings, self.server_id,
                                self._chat_places, LostSessions(open_ids), self.thinking)
        self._chat_sessions = sessions
        send = functools.partial(self._send_group, producer)
        endpoint = ChatEndpoint(sessions, rollout.sampling, self.config.model.path, send, self._chat_tools)
        port = await endpoint.start(settings, settings.port + self._index if settings.port else 0, self._chat_key)
        if self._state_dir is not None:  # written whole: an agent polling for the file never reads half of it
            write_json_whole(self._state_dir / f"{self.server_id}.chat.json", {"url": f"http://{settings.host}:{port}/v1"})
        return endpoint

    def _check_rewards(self, mixture: PromptMixture) -> None:
        """Fail now, not at the first scored group after the engine started, on a reward function that does
        not load or data that no built-in scorer handles (environments reward their own data)."""
        validation_rows = [prompt.row for prompt in self.validator.prompts] if self.validator else []
        sources = {row.data_source for row in itertools.chain(*mixture.sources, validation_rows)}
        check_reward_setup(self.config.reward, {source for source in sources if not self.environments.handles(source)})

    def _validator(self, server_index: int) -> Validator | None:
        if server_index != VALIDATING_SERVER or not self.config.validation.during_run:
            return None
        prompts = load_validation_prompts(self.config, self.tokenizer)
        log.info("validating every %d versions on %d held-out prompts", self.config.validation.every, len(prompts))
        return Validator(self.config.validation, self.config.rollout.sampling, prompts, self.tokenizer, self.config.run.seed)

    def _start_validation(self, engine: RolloutEngine, scorer: RewardScorer, agent: AgentLoop) -> asyncio.Task | None:
        """The background task that validates due versions (server 0 with validation on), or None."""
        if self.validator is None:
            return None
        return asyncio.create_task(self.validator.run_when_due(engine, scorer, self.config.rollout.poll_s, agent))

    def _reports(self, engine: RolloutEngine) -> list[ServerTelemetry | ValidationResult]:
        """What the server tells the learner every heartbeat period: its counters, and its latest validation passes
        (again each time: the learner logs each pass once, and hears them after a restart too)."""
        validated = self.validator.results(self.server_id) if self.validator else []
        return [self._telemetry(engine), *validated]

    def _telemetry(self, engine: RolloutEngine) -> ServerTelemetry:
        return ServerTelemetry(
            self.server_id, engine.current_version,
            tokens_generated=engine.tokens_sampled,
            groups_sent=self.stats.groups_sent,
            idle_seconds=self.stats.idle_seconds,
            uptime_seconds=time.perf_counter() - self._started,
            inflight=engine.inflight_requests,
            chat_sessions=self._chat_places.open,
            chat_waiting=self._chat_places.waiting,
            chat_dropped_idle=self._chat_sessions.dropped_idle if self._chat_sessions else 0,
            chat_lost=self._chat_sessions.lost.refused if self._chat_sessions else 0,
            thrown_away_tokens=self.stats.tokens_cut + (self._chat_sessions.tokens_dropped if self._chat_sessions else 0),
        )

    def stop(self) -> None:
        self._stop.set()

    def finish(self, version: int) -> None:
        """The learner ended the job at `version`: stop generating."""
        log.info("the learner finished the job at step %d: %s stops", version, self.server_id)
        ignore_stop_signals()  # its supervisor stops the other servers now: this one's teardown runs to its end
        self.finished_version = version
        self.stop()

    async def leave(self, version: int) -> None:
        """`finish`, and return once nothing is being sent to the buffer any more (the learner closes it when
        every server has left)."""
        self._leaving = True
        self.finish(version)
        await self._buffer_quiet.wait()

    async def _let_the_leaving_answer_go(self, answering: asyncio.Task) -> None:
        """A server that `leave`s answers the learner from `answering` (the sync client's task) once `leave` returns,
        which is when this teardown has begun: cancelled now, the task would never answer, and the learner would wait
        rollout.weight_sync.liveness_s for it. Bounded: a learner gone meanwhile would never take the answer."""
        if self._leaving:
            await asyncio.wait([answering], timeout=LEAVING_ANSWER_TIMEOUT_S)

    async def _generate_forever(self, engine: RolloutEngine, agent: AgentLoop, admission: AdmissionClient,
                                producer: TrajectoryProducer, scorer: RewardScorer) -> None:
        # Prompts the previous process of this server was granted and left unacknowledged come first, once the
        # weights are within the bound; the buffer still counts them as running, so they need no new grant.
        gate, running = StartGate(self.prompts.owed), set()
        try:
            await self._generate_until_stopped(engine, agent, admission, producer, scorer, running, gate)
        finally:  # stopped: what is still sampled is regenerated by this server's next process, if any
            await cancel_and_wait(running)
            # a cancelled task's request may still run in its thread (a group being acknowledged): let it end
            await self._buffer.stop(self.config.buffer.client_timeout_s)
            self._buffer_quiet.set()

    async def _generate_until_stopped(self, engine: RolloutEngine, agent: AgentLoop, admission: AdmissionClient,
                                      producer: TrajectoryProducer, scorer: RewardScorer, running: set[asyncio.Task],
                                      gate: StartGate) -> None:
        """Start groups as admission and the staleness rule allow, keeping `running` (updated in place) the set of
        those not done."""
        rollout = self.config.rollout
        grant = await self._ask(admission, 0, len(running) + gate.waiting)
        while not self._stop.is_set():
            # Every granted group counts against the staleness bound until reported finished, so ask only for
            # what will be started now: nothing while the weights lag by more than K. K is the one the buffer's
            # last grant named: the learner may change it during the run. The gate judges each start by the
            # newest grant, so a group never starts from weights more than K behind the learner it names.
            wanted = self._asks.wanted(len(running)) if gate.is_open(grant, engine) else 0
            grant = await self._ask(admission, wanted, len(running) + gate.waiting)
            gate.admit(self._chat_places.take_grants(grant.granted))  # waiting chat sessions come first
            for _ in range(gate.release(grant, engine)):
                running.add(self._start_group(engine, agent, producer, scorer, grant.policy_version))
            idle_from = time.perf_counter() if not running else None
            if running:
                done, _ = await asyncio.wait(running, timeout=rollout.poll_s, return_when=asyncio.FIRST_COMPLETED)
                running -= done
                for task in done:
                    task.result()  # a bug, or the learner back elsewhere: it ends the server (the supervisor restarts it)
            else:
                await asyncio.sleep(rollout.poll_s)
            if idle_from is not None:
                self.stats.idle_seconds += time.perf_counter() - idle_from

    async def _ask(self, admission: AdmissionClient, wanted: int, running: int):
        """Ask admission for `wanted` more groups while `running` ones are not done (every done task has
        counted itself finished); its answer tells the validator where the learner is."""
        grant = await self._buffer.call(admission.request, *self._asks.ask(wanted, running))
        if self.validator is not None:
            self.validator.follow(grant.policy_version, grant.max_staleness)
        return grant

    async def _send_group(self, producer: TrajectoryProducer, group: TrajectoryGroup) -> Ack:
        """The one way a group reaches the buffer, a prompt's or a chat session's: acknowledged, sent again while the
        buffer does not answer, and waited for by a leaving server (`BufferCalls`)."""
        return await self._buffer.call(producer.send, group)

    def _start_group(self, engine: RolloutEngine, agent: AgentLoop, producer: TrajectoryProducer,
                     scorer: RewardScorer, learner_version: int) -> asyncio.Task:
        """Sample the next prompt's group in a task, started while the learner is at `learner_version`; its samples
        hold their slots from now on."""
        slots = self._slots.claim(self.config.rollout.sampling.n)
        return asyncio.create_task(self._one_group(engine, agent, producer, scorer, slots, learner_version))

    async def _one_group(self, engine: RolloutEngine, agent: AgentLoop, producer: TrajectoryProducer,
                         scorer: RewardScorer, slots: Claim, learner_version: int) -> None:
        await self.groups.sample(engine, agent, scorer, slots, functools.partial(self._send_group, producer),
                                 learner_version)
        self._asks.group_finished()


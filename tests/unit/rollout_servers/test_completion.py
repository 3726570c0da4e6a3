"""Building a Completion from vLLM's final output: bulk log-probs, exact version spans, else the update
boundaries the engine recorded while paused."""

import asyncio
from types import SimpleNamespace

import pytest
from vllm.logprobs import FlatLogprobs, Logprob

from rollout_servers import vllm_compat
from rollout_servers.completion import TokenStream


def flat(token_ids: list[int], logprobs: list[float]) -> FlatLogprobs:
    positions = range(len(token_ids))
    return FlatLogprobs(list(positions), [p + 1 for p in positions], list(token_ids), list(logprobs),
                        [1] * len(token_ids), [None] * len(token_ids))


def output(token_ids, logprobs, finish_reason=None, spans=None):
    completion = SimpleNamespace(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason,
                                 weight_versions=spans)
    return SimpleNamespace(outputs=[completion])


def span(version: int, start: int, end: int):
    return SimpleNamespace(version=str(version), start=start, end=end)


def test_flat_logprobs_are_taken_in_bulk():
    assert vllm_compat.sampled_logprobs(flat([5, 6, 7], [-0.1, -0.2, -0.3]), [5, 6, 7]) == [-0.1, -0.2, -0.3]


def test_flat_logprobs_of_other_tokens_are_refused():
    with pytest.raises(RuntimeError, match="do not match"):
        vllm_compat.sampled_logprobs(flat([5, 9], [-0.1, -0.2]), [5, 6])


def test_per_position_dicts_give_the_sampled_tokens_entry():
    steps = [{5: Logprob(-0.5), 8: Logprob(-2.0)}, {6: Logprob(-0.25)}]
    assert vllm_compat.sampled_logprobs(steps, [5, 6]) == [-0.5, -0.25]


def test_final_output_takes_versions_from_exact_spans():
    """A final-only output arrives after the update: its arrival tag would be wrong, the spans are not."""
    stream = TokenStream("r", [1, 2], start_version=3)
    stream.version_changed(2, 4)  # spans win over boundaries where vLLM reports them
    stream.absorb(output([5, 6, 7, 8], flat([5, 6, 7, 8], [-1.0] * 4), "length", [span(3, 0, 3), span(4, 3, 4)]))
    completion = stream.completion()
    assert completion.versions == [3, 3, 3, 4]
    assert completion.version_counts() == {3: 3, 4: 1}
    assert completion.logprobs == [-1.0] * 4 and completion.finish_reason == "length"


def test_without_spans_the_update_boundaries_give_the_versions():
    stream = TokenStream("r", [1], start_version=0)
    stream.version_changed(2, 1)  # two tokens sampled when version 1 arrived
    stream.version_changed(4, 3)
    stream.absorb(output([5, 6, 7, 8, 9], flat([5, 6, 7, 8, 9], [-1.0, -2.0, -3.0, -4.0, -5.0]), "stop"))
    completion = stream.completion()
    assert completion.token_ids == [5, 6, 7, 8, 9] and completion.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert completion.versions == [0, 0, 1, 1, 3]
    assert completion.finish_reason == "stop"


def test_an_update_before_the_first_token_labels_every_token_new():
    stream = TokenStream("r", [1], start_version=2)
    stream.version_changed(0, 3)
    stream.absorb(output([5, 6], flat([5, 6], [-1.0, -2.0]), "length"))
    assert stream.completion().versions == [3, 3]


def test_an_update_after_the_final_output_arrived_labels_every_token_old():
    """vLLM has handed the request its final output (so its output processor no longer counts it) but the reader
    has not returned yet when the engine pauses: every token was sampled before the update."""
    stream = TokenStream("r", [1], start_version=2)
    stream.absorb(output([5, 6, 7], flat([5, 6, 7], [-1.0] * 3), "stop"))
    stream.version_changed(0, 3)
    assert stream.completion().versions == [2, 2, 2]


class _QueuedOutputsCore:
    """vLLM's engine client as a keep-mode pause leaves it: the core's last outputs arrive on the ordered socket
    before the pause's acknowledgement, so they sit in `outputs_queue` when `pause_scheduler_async` returns."""

    def __init__(self, batches: list[int]) -> None:
        self.outputs_queue: asyncio.Queue[int] = asyncio.Queue()
        self.batches = batches
        self.pause_modes: list[str] = []

    async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
        self.pause_modes.append(mode)
        for outputs in self.batches:
            self.outputs_queue.put_nowait(outputs)


class _PausableEngine:
    def __init__(self, core: _QueuedOutputsCore) -> None:
        self.engine_core = core

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        raise AssertionError("the pause asks the engine core itself (vLLM's own pause sleeps a fixed 20 ms)")


async def _count_like_vllm(core: _QueuedOutputsCore, counted: list[int], chunk: int) -> None:
    """vLLM's output handler: takes one queued output at a time and yields between chunks of requests."""
    while True:
        outputs = await core.outputs_queue.get()
        for start in range(0, outputs, chunk):
            counted.append(min(chunk, outputs - start))
            if start + chunk < outputs:
                await asyncio.sleep(0)  # one loop turn, no time: vLLM's handler yields between chunks


def test_a_keep_mode_pause_returns_once_every_output_sent_before_it_is_counted() -> None:
    async def pause_and_read() -> tuple[int, list[str]]:
        core = _QueuedOutputsCore(batches=[300, 5, 129])  # requests per step output: several chunks of 128
        counted: list[int] = []
        handler = asyncio.create_task(_count_like_vllm(core, counted, chunk=128))
        await vllm_compat.pause_keeping_requests(_PausableEngine(core))
        seen = sum(counted)
        handler.cancel()
        return seen, core.pause_modes

    seen, modes = asyncio.run(pause_and_read())
    assert seen == 300 + 5 + 129
    assert modes == ["keep"]

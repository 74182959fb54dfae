"""One API request's run through the engine loop: its prompts (one per
choice) submitted together, their tokens turned into text deltas with stop
strings applied, and their metrics recorded.

The engine thread calls back with `Update`s; they are hopped onto the
server's event loop and read from one queue, tagged by choice index. A
request whose client goes away (the task is cancelled) is aborted in the
engine, so it stops taking a batch slot, and its choices are recorded in the
metrics as finished by "abort" once the engine's last update for each arrives.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from engine.llm import RequestOutput
from engine.sequence import SamplingParams
from engine.server.engine_loop import EngineLoop, Request, Update
from engine.server.metrics import ServerMetrics
from engine.server.text_stream import TextStream


class EngineFailed(Exception):
    """The engine failed a request (its step raised, or it is shutting down)."""


@dataclass(slots=True)
class Delta:
    """New text of choice `index`; `finish_reason` and `output` are set on its last delta."""

    index: int
    text: str
    finish_reason: str | None = None
    output: RequestOutput | None = None


class Generation:
    """Runs prompts (one per choice) through `loop` and yields their deltas."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, tokenizer, prompts: list[list[int]],
                 params: list[SamplingParams], stop: list[str]) -> None:
        assert len(prompts) == len(params)
        self.loop, self.metrics = loop, metrics
        self._prompts, self._params = prompts, params
        self._streams = [TextStream(tokenizer, stop, sp.min_tokens) for sp in params]
        self._requests: list[Request] = []
        self._last = [0.0] * len(prompts)
        self.outputs: list[RequestOutput | None] = [None] * len(prompts)
        self._abandoned = False  # the reader went away: last updates go to the metrics only

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's text as it is released, then its finish; aborts what is left when cancelled."""
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        for i, (ids, sp) in enumerate(zip(self._prompts, self._params)):
            emit = (lambda u, i=i: aio.call_soon_threadsafe(self._deliver, queue, i, u))
            self._requests.append(self.loop.submit(ids, sp, emit))
            self._last[i] = time.perf_counter()
        left = len(self._requests)
        try:
            while left:
                i, update = await queue.get()
                delta = self._apply(i, update)
                if delta.finish_reason is not None:
                    left -= 1
                if delta.text or delta.finish_reason is not None:
                    yield delta
        finally:
            if left:
                self._abandoned = True
                while not queue.empty():
                    self._deliver(queue, *queue.get_nowait())
                for req in self._requests:
                    self.loop.abort(req)

    def completion_tokens(self, i: int) -> int:
        """Choice i's tokens up to the one that completed its stop string (the engine, aborted a step
        later, may have made more)."""
        made, stream = len(self.outputs[i].token_ids), self._streams[i]
        return min(made, len(stream.ids)) if stream.stopped else made

    def _deliver(self, queue: asyncio.Queue, i: int, u: Update) -> None:
        """On the event loop: an update to read, or, once the reader went away, a last one to count."""
        if not self._abandoned:
            queue.put_nowait((i, u))
        elif u.output is not None and self.outputs[i] is None:
            self.outputs[i] = u.output
            self.metrics.finished(u.output, u.output.finish_reason or "abort")

    def _apply(self, i: int, u: Update) -> Delta:
        if u.error is not None:
            raise EngineFailed(u.error)
        if u.new_token_ids:
            self.metrics.token_gap(u.at - self._last[i], len(u.new_token_ids))
            self._last[i] = u.at
        stream = self._streams[i]
        was_stopped = stream.stopped
        ids = u.new_token_ids
        stop_token = u.output is not None and u.output.finish_reason == "stop" and ids \
            and ids[-1] in self._params[i].stop_token_ids
        if stop_token:
            ids = ids[:-1]  # a stop token's text is not output (as in vLLM); it counts as generated
        text = stream.feed(ids, final=u.output is not None)
        if stream.stopped and not was_stopped and u.output is None:
            self.loop.abort(self._requests[i])  # a stop string: the engine need not go on
        if u.output is None:
            return Delta(i, text)
        reason = "stop" if stream.stopped else ("length" if u.output.finish_reason == "length" else "stop")
        self.outputs[i] = u.output
        self.metrics.finished(u.output, reason)
        return Delta(i, text, reason, u.output)

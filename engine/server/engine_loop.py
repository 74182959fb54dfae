"""One thread drives the engine; requests arrive from any thread and get their tokens back as they come.

The engine (engine/llm.py) is single-threaded: `step()` runs one batched
forward. `EngineLoop` owns it on a thread of its own: between steps it takes
new requests and aborts from an inbox, it steps while any request is queued
or running (continuous batching: a request that arrives mid-generation joins
the next step), and after each step it hands every request its new tokens
through the callback the request came with (called on the engine thread; the
HTTP server hops to its event loop from there).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.llm import LLM, RequestOutput
from engine.sequence import SamplingParams, Sequence

log = logging.getLogger("tierkv.engine_loop")
IDLE_WAIT_S = 0.5  # how long the idle thread sleeps on its inbox before looking at the stop flag again
FAILED_PAUSE_S = (0.05, 2.0)  # after a failed step, the loop waits this long, doubling to the most, before again


@dataclass(slots=True)
class Update:
    """What one step did for one request."""

    new_token_ids: list[int]
    output: RequestOutput | None = None  # set once the request finished
    error: str | None = None  # the engine failed this request
    at: float = field(default_factory=time.perf_counter)


@dataclass(slots=True, eq=False)
class Request:
    """A request handed to the loop; `emit` receives its updates on the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Update], None]
    seq: Sequence | None = None
    sent: int = 0  # output tokens already emitted


class EngineLoop:
    """Drives `llm` on a background thread (see the module docstring)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue[tuple[str, Request | None]] = queue.SimpleQueue()
        self._live: list[Request] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tierkv-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Update], None]) -> Request:
        """Queue a request (prompt already validated by `llm.prompt_ids`)."""
        req = Request(prompt_ids, params, emit)
        self._inbox.put(("add", req))
        return req

    def abort(self, req: Request) -> None:
        """Stop a request; it still gets a last update, with its output."""
        self._inbox.put(("abort", req))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def num_running(self) -> int:
        return len(self.llm.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.llm.scheduler.waiting)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (requests still live get an error update)."""
        self._closed = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout_s)

    def _run(self) -> None:
        pause = FAILED_PAUSE_S[0]
        while not self._closed:
            try:  # dispatch boundary: fail the live requests, keep serving (a dead thread left them all hanging)
                self._take_inbox(wait=not self.llm.has_work())
                if self.llm.has_work():
                    self.llm.step()
                    self._publish()
                pause = FAILED_PAUSE_S[0]
            except Exception as e:
                log.exception("engine step failed (next try in %.2f s)", pause)
                self._fail_all(f"engine step failed: {e}")
                time.sleep(pause)  # what keeps failing is not tried (and logged) thousands of times a second
                pause = min(2 * pause, FAILED_PAUSE_S[1])
        self._fail_all("the engine is shutting down")

    def _take_inbox(self, wait: bool) -> None:
        try:
            items = [self._inbox.get(timeout=IDLE_WAIT_S) if wait else self._inbox.get_nowait()]
        except queue.Empty:
            return
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, req in items:
            if kind == "add":
                try:
                    req.seq = self.llm.add_request(req.prompt_ids, req.params)
                except Exception as e:  # dispatch boundary: this request fails, the others go on
                    self._emit(req, Update([], error=str(e)))
                    continue
                self._live.append(req)
            elif kind == "abort" and req.seq is not None:
                self._abort(req)
        if any(kind == "abort" for kind, _ in items):
            self._publish()

    def _abort(self, req: Request) -> None:
        try:
            self.llm.abort(req.seq)
        except Exception as e:  # this request fails alone; the rest of the inbox goes on
            log.exception("aborting a request failed")
            self._fail(req, f"abort failed: {e}")

    def _publish(self) -> None:
        """Each live request's new tokens; the finished ones leave the loop."""
        for req in list(self._live):
            try:
                out = req.seq.output_token_ids
                new, req.sent = out[req.sent:], len(out)
                if req.seq.is_finished:
                    update = Update(new, self.llm.output(req.seq))
                    self._live.remove(req)
                    self._emit(req, update)
                elif new:
                    self._emit(req, Update(new))
            except Exception as e:  # this request's answer cannot be built: it fails, the others go on
                log.exception("handing out a request's tokens failed")
                self._fail(req, f"engine step failed: {e}")

    def _fail(self, req: Request, why: str) -> None:
        if req in self._live:
            self._live.remove(req)
        try:
            if req.seq is not None and not req.seq.is_finished:
                self.llm.scheduler.abort(req.seq)
        except Exception:  # its pages may stay taken; the request still gets its answer
            log.exception("aborting a failed request")
        self._emit(req, Update([], error=why))

    def _fail_all(self, why: str) -> None:
        for req in list(self._live):
            self._fail(req, why)

    @staticmethod
    def _emit(req: Request, update: Update) -> None:
        try:
            req.emit(update)
        except Exception:  # a consumer's failure must not stop the engine
            log.exception("request update callback failed")

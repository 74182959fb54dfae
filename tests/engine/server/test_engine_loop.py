"""The engine's thread under failure: whatever raises between steps, the
live requests get an error and the loop goes on serving (tiny-random, float32)."""
from __future__ import annotations

import queue

from engine.sequence import SamplingParams
from engine.server.engine_loop import EngineLoop


def run(loop: EngineLoop, ids: list[int], max_tokens: int = 4) -> list:
    got: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), got.put)
    updates = [got.get(timeout=60)]
    while updates[-1].output is None and updates[-1].error is None:
        updates.append(got.get(timeout=60))
    return updates


def test_a_failure_outside_the_step_fails_the_live_requests_not_the_loop(tiny_llm_factory, tiny_prompts):
    llm = tiny_llm_factory()
    loop = EngineLoop(llm)
    try:
        # Building a finished request's output raises once (after the step, as the loop hands out tokens).
        real = llm.output

        def broken(seq):
            llm.output = real
            raise RuntimeError("output failed")
        llm.output = broken
        # That request gets an error, not silence...
        assert run(loop, tiny_prompts[0])[-1].error == "engine step failed: output failed"
        # ...and the next one is served by the same, living loop.
        assert run(loop, tiny_prompts[1])[-1].output is not None and loop.alive
    finally:
        loop.close()


def test_one_requests_failure_fails_it_alone(tiny_llm_factory, tiny_prompts):
    llm = tiny_llm_factory()
    loop = EngineLoop(llm)
    try:
        real = llm.output

        def broken(seq):  # building the first finished output fails (the short request's)
            llm.output = real
            raise RuntimeError("output failed")
        llm.output = broken
        short, long = queue.SimpleQueue(), queue.SimpleQueue()
        loop.submit(tiny_prompts[1], SamplingParams(max_tokens=8, ignore_eos=True), long.put)
        loop.submit(tiny_prompts[0], SamplingParams(max_tokens=2, ignore_eos=True), short.put)

        def last(q):
            u = q.get(timeout=60)
            while u.output is None and u.error is None:
                u = q.get(timeout=60)
            return u
        # The short one gets its error; the long one, batched with it, still gets its answer.
        assert last(short).error == "engine step failed: output failed"
        assert last(long).output is not None and loop.alive
    finally:
        loop.close()

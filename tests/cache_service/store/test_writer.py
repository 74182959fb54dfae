"""The writer's queue: a store waiting for room stops waiting once the writer
is stuck (a tier that hangs, in a batch or in its tick), never while it is
merely slow with a large batch."""
from __future__ import annotations

import threading
import time

import torch

from cache_service.store.writer import SLOW_BPS, TierWriter


def items(n: int, nbytes: int = 16) -> list:
    return [(bytes([i % 256]) * 16, torch.zeros(nbytes, dtype=torch.uint8)) for i in range(n)]


def test_a_store_stops_waiting_for_a_writer_stuck_in_its_tick():
    hang = threading.Event()
    w = TierWriter("t", depth=2, write=lambda batch: None, tick=lambda: hang.wait(20), tick_s=0.01)
    time.sleep(0.1)  # the writer is in its tick now, which hangs (an S3 that never answers)
    # A store waiting for room gives up once the writer has been stuck for stuck_s, not the tick's 20 s.
    t = time.monotonic()
    done = w.submit_many(items(6), wait=True, stuck_s=0.5)
    assert done < 6 and time.monotonic() - t < 5
    hang.set()
    w.stop(5)


def test_a_slow_writer_with_a_large_batch_is_waited_for():
    def write(batch):  # healthy, at well over SLOW_BPS, but a batch takes longer than stuck_s
        time.sleep(1.0)
    w = TierWriter("t", depth=2, write=write, batch=2)
    big = items(8, nbytes=SLOW_BPS)  # two of these take 2 s at SLOW_BPS; the writer takes 1 s
    # Every item is queued: the wait outlasts stuck_s (0.5 s) because each batch's bytes allow it more.
    assert w.submit_many(big, wait=True, stuck_s=0.5) == 8
    assert w.flush(30)
    w.stop(5)

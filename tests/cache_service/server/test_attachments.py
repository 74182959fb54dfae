"""The daemon's attachments of client segments: limits that hold under
concurrent attaches, and a share per tenant, so one tenant cannot take every
attachment from the others."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from cache_service.protocol.messages import RequestError
from cache_service.protocol.segment import Segment
from cache_service.server.attachments import Attachments


@pytest.fixture
def segments(tmp_path):
    made: list[Segment] = []

    def make(n: int) -> list[Segment]:
        made.extend(Segment(4096, tmp_path) for _ in range(n))
        return made[-n:]

    make.dir = tmp_path
    yield make
    for seg in made:
        seg.close()


def test_one_tenant_cannot_take_every_attachment(segments):
    att = Attachments(segments.dir, max_count=8)
    # acme attaches its share (a quarter of the limit); one more is refused.
    acme = segments(3)
    for seg in acme[:2]:
        att.attach(seg.name, seg.nonce, "acme")
    with pytest.raises(RequestError) as e:
        att.attach(acme[2].name, acme[2].nonce, "acme")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "acme" in str(e.value)
    # globex still attaches.
    [seg] = segments(1)
    assert att.attach(seg.name, seg.nonce, "globex")[1] == 4096
    assert att.counts()[0] == 3


def test_concurrent_attaches_never_pass_the_limit(segments, monkeypatch):
    att = Attachments(segments.dir, max_count=4)
    opened = att._open

    def slow_open(name):  # every attach is between its check and its registration at once
        time.sleep(0.2)
        return opened(name)

    monkeypatch.setattr(att, "_open", slow_open)
    results: list[bool] = []

    def attach(seg: Segment) -> None:
        try:
            att.attach(seg.name, seg.nonce, None)
            results.append(True)
        except RequestError:
            results.append(False)

    threads = [threading.Thread(target=attach, args=(seg,)) for seg in segments(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # Four attach, four are refused; a failed attach gives its place back.
    assert sorted(results) == [False] * 4 + [True] * 4 and att.counts()[0] == 4
    [seg] = segments(1)
    with pytest.raises(RequestError):
        att.attach(seg.name, b"\0" * len(seg.nonce), None)  # a wrong nonce
    assert att._pending == {None: 0}

"""chunked_prefix (cache_service/store/prefix.py): the run of positions an
asker answers True for, asked in chunks that double, stopping at the first miss."""
from __future__ import annotations

from cache_service.store.prefix import chunked_prefix


def asker(held: list[bool], asked: list[tuple[int, int]]):
    def ask(a: int, b: int) -> list[bool]:
        asked.append((a, b))
        return held[a:b]
    return ask


def test_a_cold_tail_costs_one_small_request():
    asked: list[tuple[int, int]] = []
    # 1,000 positions, none held: one request about the first 32.
    assert chunked_prefix(0, 1000, asker([False] * 1000, asked)) == 0
    assert asked == [(0, 32)]


def test_chunks_double_until_the_first_miss():
    asked: list[tuple[int, int]] = []
    # 100 held, then a miss, then more held: chunks of 32, 64, 128; the prefix ends at the miss.
    held = [True] * 100 + [False] + [True] * 400
    assert chunked_prefix(0, len(held), asker(held, asked)) == 100
    assert asked == [(0, 32), (32, 96), (96, 224)]


def test_all_held_asks_up_to_the_end_and_no_further():
    asked: list[tuple[int, int]] = []
    assert chunked_prefix(0, 50, asker([True] * 50, asked)) == 50
    assert asked == [(0, 32), (32, 50)]
    # Nothing to ask about: no request.
    assert chunked_prefix(0, 0, asker([], asked)) == 0 and len(asked) == 2


def test_a_run_from_a_later_start_is_asked_from_there():
    asked: list[tuple[int, int]] = []
    # Positions 0-9 settled elsewhere; from 10, 40 held: asked from 10 on, the run ends at 50.
    held = [False] * 10 + [True] * 40 + [False] * 50
    assert chunked_prefix(10, 100, asker(held, asked)) == 50
    assert asked == [(10, 42), (42, 100)]

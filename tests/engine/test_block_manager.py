"""Page allocation, ref counts and the prefix cache of the block manager."""
from __future__ import annotations

from cache_service.blocks.keys import chain_hashes
from engine.block_manager import BlockManager
from engine.sequence import SamplingParams, Sequence

ROOT = bytes(range(16))


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def computed(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Pretend the model computed the first n tokens of seq."""
    assert bm.ensure_pages(seq, n)
    seq.num_computed_tokens = n
    bm.commit(seq)


def test_full_pages_are_hashed_with_the_shared_chain():
    bm = BlockManager(num_pages=8, page_size=4, root_hash=ROOT)
    seq = seq_of(range(10))
    computed(bm, seq, 10)
    # two full pages are registered under cache_service's chained hashes; the partial third is not
    assert seq.block_hashes == chain_hashes(ROOT, list(range(8)), 4)
    assert [bm.hash_to_page[h] for h in seq.block_hashes] == seq.page_table[:2]
    assert bm.page_hash[seq.page_table[2]] is None


def test_match_shares_pages_and_counts_refs():
    bm = BlockManager(num_pages=8, page_size=4, root_hash=ROOT)
    a = seq_of(range(12))
    computed(bm, a, 12)
    # b shares a's first two pages and diverges in the third
    b = seq_of([*range(8), 99, 98, 97], seq_id=1)
    assert bm.match_prefix(b) == 8
    assert b.page_table == a.page_table[:2]
    assert [bm.ref_counts[p] for p in a.page_table] == [2, 2, 1]
    # the whole prompt cached still leaves the last token to compute
    c = seq_of(range(12), seq_id=2)
    assert bm.match_prefix(c) == 8
    bm.free(a), bm.free(b), bm.free(c)
    assert bm.num_free_pages == 8 and not any(bm.ref_counts)


def test_freed_cached_pages_are_reused_lru_after_plain_ones():
    bm = BlockManager(num_pages=4, page_size=2, root_hash=ROOT)
    a, b = seq_of([1, 2, 3]), seq_of([5, 6, 7], seq_id=1)
    computed(bm, a, 2)
    computed(bm, b, 2)
    bm.free(a)
    bm.free(b)
    # a's page was freed first, so it is the first cached page evicted; plain pages go before both
    fresh = seq_of([9, 9, 9, 9, 9, 9, 9], seq_id=2)
    assert bm.ensure_pages(fresh, 6)
    assert a.block_hashes[0] not in bm.hash_to_page
    assert bm.hash_to_page[b.block_hashes[0]] not in fresh.page_table
    # b's prefix is still matchable
    again = seq_of([5, 6, 7], seq_id=3)
    assert bm.match_prefix(again) == 2


def test_ensure_pages_is_all_or_nothing():
    bm = BlockManager(num_pages=3, page_size=4, root_hash=ROOT)
    seq = seq_of(range(20))
    assert not bm.ensure_pages(seq, 13)
    assert seq.page_table == [] and bm.num_free_pages == 3
    assert bm.ensure_pages(seq, 12) and len(seq.page_table) == 3


def test_prefix_caching_off_never_matches():
    bm = BlockManager(num_pages=8, page_size=4, root_hash=ROOT, enable_prefix_caching=False)
    a = seq_of(range(12))
    computed(bm, a, 12)
    assert not bm.hash_to_page
    assert bm.match_prefix(seq_of(range(12), seq_id=1)) == 0

"""Page allocation with ref counts and prefix caching by page.

Each full page of computed KV is keyed by a chained 16-byte hash of its tokens
(``cache_service.blocks.keys.chain_hashes`` from the model's namespace fingerprint).
A page whose ref count drops to zero keeps its hash and its KV: it sits in an
LRU of free cached pages and a later request with the same prefix takes it
back. Allocation prefers never-cached pages and otherwise evicts the least
recently freed cached page.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from cache_service.blocks.keys import chain_hashes
from engine.sequence import Sequence


class BlockManager:
    """Owns the page ids of the KV cache; sequences hold them through `page_table`."""

    def __init__(self, num_pages: int, page_size: int, root_hash: bytes, enable_prefix_caching: bool = True):
        assert len(root_hash) == 16
        self.num_pages, self.page_size, self.root_hash = num_pages, page_size, root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        self.free_plain: deque[int] = deque(range(num_pages))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first

    @property
    def num_free_pages(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache ----------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Take the cached pages of `seq`'s longest cached prefix; returns its length in tokens.

        At least the last token is left to compute (its logits are needed).
        Call on a sequence that holds no pages.
        """
        assert not seq.page_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        max_pages = (seq.num_tokens - 1) // self.page_size
        for h in self._hashes(seq, max_pages)[:max_pages]:
            page = self.hash_to_page.get(h)
            if page is None:
                break
            self._ref(page)
            seq.page_table.append(page)
        seq.num_registered_pages = len(seq.page_table)
        return len(seq.page_table) * self.page_size

    def commit(self, seq: Sequence) -> None:
        """Offer `seq`'s newly completed full pages to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.page_size
        hashes = self._hashes(seq, n_full)
        for i in range(seq.num_registered_pages, n_full):
            page, h = seq.page_table[i], hashes[i]
            # the same prefix may have been computed twice concurrently: keep the first page
            if self.page_hash[page] is None and h not in self.hash_to_page:
                self.page_hash[page] = h
                self.hash_to_page[h] = page
        seq.num_registered_pages = max(seq.num_registered_pages, n_full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page no sequence holds (they become plain free pages)."""
        while self.free_cached:
            page, _ = self.free_cached.popitem(last=False)
            del self.hash_to_page[self.page_hash[page]]
            self.page_hash[page] = None
            self.free_plain.append(page)

    def _hashes(self, seq: Sequence, n_pages: int) -> list[bytes]:
        have = len(seq.block_hashes)
        if have < n_pages:
            parent = seq.block_hashes[-1] if have else self.root_hash
            ps = self.page_size
            seq.block_hashes.extend(chain_hashes(parent, seq.token_ids[have * ps : n_pages * ps], ps))
        return seq.block_hashes

    # ---- allocation ------------------------------------------------------------------

    def ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s page table to cover `num_tokens`; False (and no change) if pages are short."""
        need = self.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return True
        if need > self.num_free_pages:
            return False
        seq.page_table.extend(self._allocate() for _ in range(need))
        return True

    def truncate(self, seq: Sequence, num_pages: int) -> None:
        """Release `seq`'s pages beyond the first `num_pages`."""
        while len(seq.page_table) > num_pages:
            self._unref(seq.page_table.pop())
        seq.num_registered_pages = min(seq.num_registered_pages, num_pages)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s pages (tail first, so the prefix stays cached longest)."""
        self.truncate(seq, 0)

    def _allocate(self) -> int:
        if self.free_plain:
            page = self.free_plain.popleft()
        else:
            page, _ = self.free_cached.popitem(last=False)
            del self.hash_to_page[self.page_hash[page]]
            self.page_hash[page] = None
        assert self.ref_counts[page] == 0
        self.ref_counts[page] = 1
        return page

    def _ref(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free_cached[page]
        self.ref_counts[page] += 1

    def _unref(self, page: int) -> None:
        assert self.ref_counts[page] > 0
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if self.page_hash[page] is None:
                self.free_plain.append(page)
            else:
                self.free_cached[page] = None

"""A tenant's view of an embedded store, as the daemon gives an authenticated
tenant (cache_service/server/servicer.py): keys are ``tenant_keys(tenant, hashes)``
and objects are written and checked under ``ns.with_tenant(tenant)``. Tests
use it where an engine of one tenant shares an embedded store with others."""
from __future__ import annotations

from typing import Sequence

import torch

from cache_service.blocks.keys import Namespace, tenant_keys
from cache_service.store.tiered_store import TieredStore
from tiers.types import BlockHash


class TenantView:
    """A `CacheClient` over `store` for `tenant`; `close` leaves the store open."""

    def __init__(self, store: TieredStore, tenant: str) -> None:
        self.base, self.tenant = store, tenant

    def keys(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        return tenant_keys(self.tenant or None, hashes)

    def _ns(self, ns: Namespace) -> Namespace:
        return ns.with_tenant(self.tenant) if self.tenant else ns

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.base.lookup(self.keys(hashes))

    def load(self, ns: Namespace, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        return self.base.load(self._ns(ns), self.keys(hashes))

    def store(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> int:
        return self.base.store(self._ns(ns), self.keys(hashes), payloads)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.base.stats()

    def close(self) -> None:
        """A view owns nothing."""

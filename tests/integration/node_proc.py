"""One tierkv node in its own process, for tests/integration/test_cross_node.py.

    python -m tests.integration.node_proc '<config json>'

The config holds the store's tiers and [directory] sections (as `load_config`
overrides). The node builds its store (cpu -> its own disk -> shared S3, plus
the Redis directory), a `SessionManager`, and the tiny-random engine in
float32, prints ``{"ready": ...}`` and then answers one JSON line per
command line on stdin:

    {"op": "turn", "tenant", "session", "text", "max_tokens"}
        resume the session (if any), append the text's tokens, generate
        greedily through the tenant's view of the store, save the session
    {"op": "resume", "tenant", "session"}     token ids and loadable tokens
    {"op": "digests", "tenant", "session"}    xxh3 of each session block loaded here
    {"op": "nodes"}                           live node ids in the directory
"""
from __future__ import annotations

import json
import sys

import torch
import xxhash

from cache_service.config import load_config
from cache_service.factory import open_sessions, open_store
from cache_service.blocks.keys import prefix_hashes
from cache_service.sessions.manifests import Session, SessionManager
from connectors.engine import EngineConnector
from engine import LLM, SamplingParams
from tests.cache_service.sessions.tenant_view import TenantView


class Node:
    def __init__(self, cfg: dict) -> None:
        config = load_config(env={}, overrides=cfg)
        self.store = open_store(config)
        self.sessions = SessionManager(self.store, open_sessions(config, config.tiers.disk.path, self.store),
                                       durable_timeout_s=60.0)
        self.llm = LLM("tiny-random", dtype="float32")
        self.ns = self.llm.kv_namespace(16)

    def turn(self, tenant: str, session: str, text: str, max_tokens: int) -> dict:
        resumed, blocks = self.sessions.resume(tenant, session, self.ns, key_tenant=tenant)
        history = resumed.token_ids if resumed else []
        self.llm.set_kv_connector(EngineConnector(TenantView(self.store, tenant), self.ns, self.llm.page_size))
        prompt = history + self.llm.tokenizer.encode(text)
        out = self.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        s = self.sessions.save(Session(session, tenant=tenant, model_id=self.ns.model_id,
                                       namespace=self.ns.fingerprint().hex(), block_tokens=self.ns.block_tokens,
                                       token_ids=prompt + out.token_ids), self.ns, key_tenant=tenant)
        return {"prompt": prompt, "output": out.token_ids, "tokens": s.token_ids,
                "cached_tokens": out.num_cached_tokens, "loadable": blocks * self.ns.block_tokens}

    def resume(self, tenant: str, session: str) -> dict:
        s, blocks = self.sessions.resume(tenant, session, self.ns, key_tenant=tenant)
        return {"found": False} if s is None else {"found": True, "tokens": s.token_ids,
                                                    "loadable": blocks * self.ns.block_tokens}

    def digests(self, tenant: str, session: str) -> dict:
        """Digest of every full block of the session this node can load (None for a miss)."""
        tokens = self.sessions.resume(tenant, session)[0].token_ids
        got = TenantView(self.store, tenant).load(self.ns, prefix_hashes(self.ns, tokens))
        return {"digests": [None if p is None else xxhash.xxh3_128_hexdigest(p.contiguous().view(torch.uint8).numpy())
                            for p in got]}

    def nodes(self) -> dict:
        return {"nodes": sorted(self.store.directory.nodes())}


def main() -> None:
    torch.set_num_threads(1)
    node = Node(json.loads(sys.argv[1]))
    print(json.dumps({"ready": node.store.directory.node_id}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        print(json.dumps(getattr(node, op)(**cmd)), flush=True)
    node.store.close()


if __name__ == "__main__":
    main()

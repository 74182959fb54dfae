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
from cache_service.sessions.manifests import SessionManager
from connectors.engine import EngineConnector
from engine import LLM, SamplingParams


class Node:
    def __init__(self, cfg: dict) -> None:
        config = load_config(env={}, overrides=cfg)
        self.store = open_store(config)
        self.sessions = SessionManager(self.store, open_sessions(config, config.tiers.disk.path, self.store))
        self.llm = LLM("tiny-random", dtype="float32")
        self.ns = self.llm.kv_namespace(16)

    def turn(self, tenant: str, session: str, text: str, max_tokens: int) -> dict:
        resumed = self.sessions.resume(tenant, session, self.ns)
        history = resumed.session.token_ids if resumed else []
        self.llm.set_kv_connector(EngineConnector(self.sessions.view(tenant), self.ns, self.llm.page_size))
        prompt = history + self.llm.tokenizer.encode(text)
        out = self.llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        s = self.sessions.save(tenant, session, prompt + out.token_ids, self.ns)
        return {"prompt": prompt, "output": out.token_ids, "tokens": s.token_ids,
                "cached_tokens": out.num_cached_tokens, "loadable": resumed.loadable_tokens if resumed else 0}

    def resume(self, tenant: str, session: str) -> dict:
        r = self.sessions.resume(tenant, session, self.ns)
        return {"found": False} if r is None else {"found": True, "tokens": r.session.token_ids,
                                                    "loadable": r.loadable_tokens}

    def digests(self, tenant: str, session: str) -> dict:
        """Digest of every full block of the session this node can load (None for a miss)."""
        tokens = self.sessions.resume(tenant, session, self.ns).session.token_ids
        got = self.sessions.view(tenant).load(self.ns, prefix_hashes(self.ns, tokens))
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

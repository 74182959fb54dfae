"""Public entry point: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cache_service.blocks.keys import Namespace
from connectors.model_id import kv_namespace, model_id_for_dir
from engine.block_manager import BlockManager
from engine.config import DTYPES, EngineConfig, ModelConfig, auto_dtype
from engine.kv_connector import KVConnector
from engine.model_runner import ModelRunner
from engine.errors import PromptError
from engine.models import resolve_model
from engine.sampler import make_generator, sample
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence
from tiers.types import ConfigError

__all__ = ["LLM", "SamplingParams", "RequestOutput", "PromptError"]


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated, including a final stop token
    text: str
    finish_reason: str  # "stop" or "length"
    num_cached_tokens: int  # prompt tokens loaded through the KV connector
    num_local_cached_tokens: int  # prompt tokens hit in the engine's own prefix cache
    ttft_s: float  # request added -> first token sampled
    total_s: float  # request added -> finished


class LLM:
    """A paged-attention engine for one Llama-family model on CPU or CUDA.

    `model` is a built-in name (``smollm2``, ``tiny-random``) or a local
    safetensors directory. The KV cache is `self.kv_cache`
    (``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``).
    """

    def __init__(self, model: str, *, dtype: str = "bfloat16", device: str | torch.device | None = None,
                 kv_connector: KVConnector | None = None, page_size: int = 16, num_pages: int | None = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, kv_cache_bytes: int = 1 << 30) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = auto_dtype(self.device) if dtype == "auto" else dtype
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} not in {sorted(DTYPES)} or auto")
        self.path = resolve_model(model)
        self.model_id = model_id_for_dir(self.path)  # the same id vLLM's connector derives
        self.model_config = ModelConfig.from_dir(self.path)
        self.dtype, self.kv_dtype = DTYPES[dtype], dtype
        self.engine_config = EngineConfig(
            page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
        )
        self.engine_config.resolve(self.model_config, self.dtype)
        self.tokenizer = _load_tokenizer(self.path)
        self.runner = ModelRunner(self.path, self.model_config, self.engine_config, self.dtype, self.device)
        self.blocks = BlockManager(self.engine_config.num_pages, page_size, self.fingerprint, enable_prefix_caching)
        self.scheduler = Scheduler(self.engine_config, self.blocks, self.kv_cache, self._eos_ids())
        self.set_kv_connector(kv_connector)
        self._default_gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(7), "little"))
        self._ids = itertools.count()

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def page_size(self) -> int:
        return self.engine_config.page_size

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def fingerprint(self) -> bytes:
        """16-byte namespace fingerprint of (model, KV dtype, layout, page size): root of the page hash chain."""
        return self.kv_namespace(self.page_size).fingerprint()

    def kv_namespace(self, block_tokens: int = 16, tenant: str = "") -> Namespace:
        """The cache_service namespace of this engine's KV layout for a connector."""
        c = self.model_config
        return kv_namespace(self.path, self.kv_dtype, c.num_layers, c.num_kv_heads, c.head_dim,
                            block_tokens=block_tokens, tenant=tenant)

    def set_kv_connector(self, connector: KVConnector | None) -> None:
        """Attach (or detach, with None) the KV connector used from the next admission on."""
        if connector is not None and (connector.block_tokens <= 0 or connector.block_tokens % self.page_size):
            raise ConfigError(f"kv_connector.block_tokens {connector.block_tokens} not a positive multiple of "
                              f"page_size {self.page_size}")
        self.kv_connector = self.scheduler.connector = connector

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat, rendered with the model's own template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion (batched); outputs are in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        token_lists = [self.prompt_ids(p) for p in prompts]  # all validated before any is queued
        for sp in plist:
            self._check_ids(sp)
        seqs = [self.add_request(ids, sp) for ids, sp in zip(token_lists, plist)]
        while not all(s.is_finished for s in seqs):
            self.step()
        return [self.output(s) for s in seqs]

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Queue one prompt; drive it with `step()` (or use `generate`)."""
        ids = self.prompt_ids(prompt)
        self._check_ids(params)
        seq = Sequence(next(self._ids), ids, params, generator=make_generator(params.seed, self.device))
        self.scheduler.add(seq)
        return seq

    def _check_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in (*params.stop_token_ids, *params.logit_bias)):
            raise PromptError(f"stop_token_ids and logit_bias must name token ids in [0, {vocab})")

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (a client went away, or a stop string was met);
        its finish reason stays as set, "abort" if none was."""
        self.scheduler.abort(seq)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def warmup(self, tokens: int = 256) -> None:
        """One throwaway prefill and a few decodes with the connector detached,
        so one-time costs (allocator growth, kernel selection, lazy imports)
        are paid at load, not in the first request's TTFT (vLLM's profile run
        does the same)."""
        connector, self.scheduler.connector = self.scheduler.connector, None
        try:
            n = max(1, min(tokens, self.max_model_len - 4))
            ids = [(7 * i + 11) % self.model_config.vocab_size for i in range(n)]
            self.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))
        finally:
            self.scheduler.connector = connector
            self.blocks.reset_prefix_cache()

    def step(self) -> list[Sequence]:
        """Schedule and run one forward; returns the sequences that finished in it."""
        batch = self.scheduler.schedule()
        assert batch, "a non-empty queue must always schedule something"
        done, logits = self.runner.run(batch)
        tokens = sample(logits, done, self._default_gen, self.scheduler.eos_token_ids) if done else []
        return self.scheduler.update(batch, dict(zip(done, tokens)))

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text or ids); PromptError when empty, too long or out of the vocabulary."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise PromptError("prompt is empty")
        if len(ids) > self.max_model_len:
            raise PromptError(f"prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise PromptError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        return ids

    def output(self, seq: Sequence) -> RequestOutput:
        """Snapshot of a request (finished or not) as a RequestOutput."""
        out = seq.output_token_ids
        return RequestOutput(
            request_id=seq.seq_id, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens], token_ids=list(out),
            text=self.tokenizer.decode(out, skip_special_tokens=True), finish_reason=seq.finish_reason or "",
            num_cached_tokens=seq.num_cached_tokens, num_local_cached_tokens=seq.num_local_cached_tokens,
            ttft_s=(seq.first_token_s or seq.arrival_s) - seq.arrival_s,
            total_s=(seq.finish_s or time.perf_counter()) - seq.arrival_s,
        )

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen = self.path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.model_max_length = sys.maxsize  # the engine checks lengths itself; silences a per-encode warning
    return tok

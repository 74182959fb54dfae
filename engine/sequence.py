"""Sampling parameters and the per-request state the scheduler moves around."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from tiers.types import ConfigError


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): every token
    max_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"sampling.top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"sampling.max_tokens must be a positive int, got {self.max_tokens!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """One request: its tokens, how many have KV in the cache, and its page table."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full pages, computed lazily
    num_registered_pages: int = 0  # leading pages already offered to the prefix cache
    num_cached_tokens: int = 0  # loaded from the KV connector at its first admission
    num_local_cached_tokens: int = 0  # hit in the engine's own prefix cache at its first admission
    admitted: bool = False  # admitted once (a preempted one is admitted again: its counts stay)
    finish_reason: str | None = None  # "stop" (EOS / stop token) or "length"
    generator: torch.Generator | None = None
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

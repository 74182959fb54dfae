"""Sampling parameters and the per-request state the scheduler moves around."""
from __future__ import annotations

import math
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
    min_tokens: int = 0  # EOS and stop_token_ids cannot be picked before this many tokens
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of each token the output holds
    frequency_penalty: float = 0.0  # OpenAI's: times the count of each token in the output, subtracted
    repetition_penalty: float = 1.0  # vLLM's: logits of prompt and output tokens divided (> 0) or multiplied by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

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
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if min(self.stop_token_ids + tuple(self.logit_bias), default=0) < 0:
            raise ConfigError("sampling.stop_token_ids and logit_bias must name token ids >= 0")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"sampling.min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"sampling.{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ConfigError(f"sampling.repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ConfigError("sampling.logit_bias values must be in [-100, 100]")

    @property
    def adjusts_logits(self) -> bool:
        """Whether any of min_tokens, the penalties and logit_bias changes what the model's logits say."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


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
    prompt_mask: torch.Tensor | None = None  # which token ids the prompt holds (the repetition penalty's, made once)

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

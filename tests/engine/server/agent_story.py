"""The agent story both OpenAI-compatible servers are tested with (ours and vLLM's).

Agents take turns; after each round, while they wait on their tools, other
traffic runs. Per resumed turn it records what the server served from the
cache against the earlier conversation (prompt and output, aligned to what
the server can load).
"""
from __future__ import annotations

from typing import Callable

Seen = dict[str, list[tuple[int, int]]]  # agent -> per resumed turn (cached tokens, earlier conversation tokens)


def agents_under_pressure(ask: Callable[[str, list[dict]], object], noise: Callable[[int], None],
                          agents: dict[str, list[dict]], tool_results: list[str], turns: int, align: int) -> Seen:
    """Run `turns` rounds: `ask(agent, messages)` answers each agent (an openai ChatCompletion),
    its reply and a tool result join its messages, then `noise(round)` (not after the last)."""
    last: dict[str, tuple[int, int]] = {}
    seen: Seen = {name: [] for name in agents}
    for turn in range(turns):
        for name, messages in agents.items():
            r = ask(name, messages)
            if turn:
                p, c = last[name]
                seen[name].append((r.usage.prompt_tokens_details.cached_tokens, (p + c - 1) // align * align))
            last[name] = (r.usage.prompt_tokens, r.usage.completion_tokens)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "tool", "content": tool_results[turn % len(tool_results)]}]
        if turn + 1 < turns:
            noise(turn)
    return seen


def report(seen: Seen, server: str) -> str:
    return "".join(f"\n  {server}, {name} agent, resumed turns, cached / earlier conversation tokens: "
                   + ", ".join(f"{c}/{full}" for c, full in pairs) for name, pairs in seen.items())

"""Thread-safe counter sets: the shared behaviour of tier and directory stats.

Imports nothing of ours and nothing heavy, so the Redis directory can use it
without pulling in torch.
"""
from __future__ import annotations

from dataclasses import fields


class Counters:
    """Base of a ``@dataclass(slots=True)`` of int counters.

    The subclass declares its counters and a ``lock`` field
    (``field(default_factory=threading.Lock, repr=False, compare=False)``);
    the lock stays a field so copies and comparisons behave as for any
    dataclass field.
    """

    __slots__ = ()

    def add(self, **deltas: int) -> None:
        """Atomically add each named delta to its counter."""
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        """Every counter by name, in declaration order (the lock left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}

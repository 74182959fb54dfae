"""One lazy resolver of ``"module:attr"`` names.

Registries (the `tierkv` subcommands, the eviction policies, the tier
classes) name what they hold as ``"module:attr"`` strings, so a module is
imported only when its entry is first asked for. It lives in tiers/, the
bottom layer, so every layer above may use it.
"""
from __future__ import annotations

import importlib
from typing import Any


def resolve(target: str) -> Any:
    """The attribute `attr` of module `module` named by ``"module:attr"``
    (dots in `attr` walk nested attributes); imports the module if needed."""
    module, sep, attr = target.partition(":")
    assert sep and module and attr, f"{target!r} is not 'module:attr'"
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj

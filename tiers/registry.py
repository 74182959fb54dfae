"""One lazy resolver of ``"module:attr"`` names.

Registries (the `tierkv` subcommands, the eviction policies, the tier
classes) name what they hold as ``"module:attr"`` strings, so a module is
imported only when its entry is first asked for. It lives in tiers/, the
bottom layer, so every layer above may use it.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def resolve(target: str) -> Any:
    """The attribute `attr` of module `module` named by ``"module:attr"``
    (dots in `attr` walk nested attributes); imports the module if needed."""
    module, sep, attr = target.partition(":")
    assert sep and module and attr, f"{target!r} is not 'module:attr'"
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A package's module-level ``__getattr__`` serving `exports` (name ->
    ``"module:attr"``): its front door, importing each name on first use."""
    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return resolve(exports[name])
    return __getattr__

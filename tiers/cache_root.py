"""Where tierkv keeps its files unless told otherwise: one rule for the
store, the sessions and the engine's converted models. It lives in tiers/,
the bottom layer, so the engine and the service share it."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$TIERKV_CACHE_DIR`` or ``$XDG_CACHE_HOME/tierkv`` or ``~/.cache/tierkv``."""
    if os.environ.get("TIERKV_CACHE_DIR"):
        return Path(os.environ["TIERKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tierkv"

"""A store damaged between engine runs heals without a person (issue #18):
60 seeded trials of one to three kinds of damage each (bit flips, truncation,
zero-fill, swapped and deleted data files, random bytes in and truncation of
the lmdb index, a deleted LOCK file), each on a store also holding up to 400
blocks of other prompts, so the index spans many pages. The trials run in a
child process (tests/reliability/damage_trials.py): a crash, such as a
SIGBUS from a mapped index, is its exit status."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.reliability.conftest import ROOT, figure

pytestmark = pytest.mark.slow
TRIALS = 60


def test_seeded_damage_between_engine_runs_is_healed(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "reliability" / "damage_trials.py"), str(tmp_path),
                          str(TRIALS), "11"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    # No crash: the child ran every trial and exited normally.
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    lines = [json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{")]
    trials, totals = lines[:-1], lines[-1]
    heals = run.stderr.count("is damaged")
    figure("self_healing", trials=totals["trials"], wrong_blocks=totals["wrong"], crashes=0,
           outputs_differing=totals["not_identical"], not_healed=totals["not_healed"], index_heals=heals,
           warm_cached_tokens=totals["warm_cached_tokens"])
    assert totals["trials"] == TRIALS == len(trials)
    # No wrong block served; greedy output always that of the engine without a cache (fp32).
    assert totals["wrong"] == 0 and totals["not_identical"] == 0
    # The second run after the damage loads every block again: the store healed by itself.
    assert totals["not_healed"] == 0, [t for t in trials if not t["healed"]]
    # The index damage was real: some trials had to set an index aside and rebuild it.
    assert heals > 0

"""Goodput on an agentic trace (#17): vLLM alone, vLLM's OffloadingConnector, vLLM + LMCache, vLLM + tierkv
(without and with session hints), `tierkv serve-engine` + tierkv, and vLLM with a KV cache that holds everything.

One seeded trace (bench/_agentic_trace.py: sessions with tool pauses and sub-agents sharing one system prompt)
is replayed through each system's OpenAI server with the `openai` client at each session arrival rate. vLLM's
own KV cache (and our engine's) is sized below the sessions' working set, so reuse has to come from the tiers.

SLOs come from the unloaded cold baseline, measured first on vLLM alone: TTFT at most the cold TTFT of a
median-context prompt, TPOT at most 4x the unloaded TPOT. Goodput: requests meeting both, per second of
the run. Hit rate: cached prompt tokens over the earlier conversation of each resumed turn (aligned to the
system's load granularity). Outputs: greedy texts per (session, turn) against vLLM alone.

    python bench/agentic.py [--quick] [--plot docs/agentic.png]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from bench._agentic_trace import Replay, Result, TraceShape, make_trace  # noqa: E402
from bench._procs import cpu_line, free_port, wait_port  # noqa: E402

MODEL = "smollm2"
VLLM_PAGE = 128  # vLLM's CPU block size: its prefix cache and LMCache's chunks load whole pages
TPOT_SLO_FACTOR = 4  # a batch of up to 8 decoding sessions shares 2 cores: 4x the unloaded TPOT is still fluent
CACHE_MEMORY_GIB = 0.25  # the tierkv daemon's CPU tier and LMCache's L1, alike: below the trace's unique KV (disk below)
BYTES_PER_TOKEN = {"float32": 46_080, "bfloat16": 23_040}  # SmolLM2: 30 layers x K,V x 3 heads x 64


@dataclass(frozen=True, slots=True)
class System:
    name: str
    server: str = "vllm"  # or "ours"
    connector: str = ""  # "", "tierkv", "lmcache", "offloading"
    hints: bool = False
    big_kv: bool = False  # the upper bound: vLLM's KV cache holds everything


CONNECTORS = {  # how each connector is named in vLLM's --kv-transfer-config, given its cache's address
    "tierkv": lambda url: {"kv_connector": "TierKVConnector", "kv_connector_module_path": "connectors.vllm",
                           "kv_connector_extra_config": {"url": url}},
    "lmcache": lambda url: {"kv_connector": "LMCacheMPConnector", "kv_connector_extra_config": {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": int(url.rsplit(":", 1)[-1])}},
    "offloading": lambda url: {"kv_connector": "OffloadingConnector",
                               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
}
SYSTEMS = [System("vllm"), System("vllm_offloading", connector="offloading"),
           System("vllm_lmcache", connector="lmcache"), System("vllm_tierkv", connector="tierkv"),
           System("vllm_tierkv_hints", connector="tierkv", hints=True),
           System("serve_engine_tierkv", server="ours", connector="tierkv", hints=True),
           System("upper_bound", big_kv=True)]


# --quick: one rate, 6 short sessions, the systems its figures compare (each vLLM start costs 25-35 s here)
# each trace with vLLM's --max-model-len (its longest conversation fits, with room; vLLM's KV cache, and our
# engine's, is sized from it: `Run.small_blocks`)
QUICK = (replace(TraceShape(), sessions=6, turns=(3, 4), system_tokens=600, tool_tokens=(100, 300),
                 output_tokens=(16, 32)), 3072)
QUICK_SYSTEMS = ["vllm", "vllm_lmcache", "vllm_tierkv", "vllm_tierkv_hints"]
# the full run: every system at four rates within 25 minutes, so sessions of 3-5 turns (TraceShape() itself, 12
# sessions of 6-10 turns, takes hours on 2 cores), scaled to the dtype: in float32 6 sessions of contexts up to
# ~2k tokens; bfloat16 (--dtype, on a CPU with AVX512-BF16 or AMX) prefills ~2.5x faster, and that trace would
# leave vLLM's own KV holding ~87% of the reuse (the working set about fits), so 8 sessions whose tool results
# grow contexts to 3-5k tokens, as the trace has them
FULL = {"float32": (replace(TraceShape(), sessions=6, turns=(3, 5), tool_tokens=(120, 360), output_tokens=(16, 40)),
                    3072),
        "bfloat16": (replace(TraceShape(), sessions=8, turns=(3, 5), tool_tokens=(300, 900), output_tokens=(16, 40)),
                     6144)}
FULL_RATES = [0.25, 0.5, 1.0, 2.0]  # to past where vLLM alone meets its SLO for under half its requests (the summary's
# rate is the highest below): at 1.0 it still met it for 59-62% on both machines measured


class Run:
    """Servers of one system, started fresh (empty caches), stopped after its replay."""

    def __init__(self, work: Path, venv_py: Path, dtype: str, log, max_len: int) -> None:
        self.work, self.venv_py, self.dtype, self.log, self.max_len = work, venv_py, dtype, log, max_len
        # vLLM's KV cache (and our engine's): one longest conversation and a page, far below the working set
        self.small_blocks = max_len // VLLM_PAGE + 1
        self.procs: list[subprocess.Popen] = []

    def start(self, s: System, model_dir: str) -> str:
        """The base URL of the system's OpenAI server."""
        url = self._cache(s.connector)
        port = free_port()
        if s.server == "ours":
            kv = f"{self.small_blocks * VLLM_PAGE * BYTES_PER_TOKEN[self.dtype] >> 20}MiB"
            cmd = [sys.executable, "-m", "engine.cli", "serve-engine", "--model", model_dir, "--served-model-name",
                   MODEL, "--dtype", self.dtype, "--kv-connector", url, "--kv-cache-memory", kv, "--port", str(port)]
            self._spawn(cmd, dict(os.environ))
        else:
            self._spawn(self._vllm_cmd(s, model_dir, port, url), self._vllm_env(s))
        wait_port(port, self.procs[-1], s.name, timeout=600)
        _wait_health(f"http://127.0.0.1:{port}", self.procs[-1])
        return f"http://127.0.0.1:{port}"

    def _vllm_cmd(self, s: System, model_dir: str, port: int, url: str) -> list[str]:
        cmd = [str(self.venv_py), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", MODEL, "--port", str(port), "--dtype", self.dtype, "--max-model-len", str(self.max_len),
               "--enforce-eager", "--enable-prompt-tokens-details"]
        if not s.big_kv:
            cmd += ["--num-gpu-blocks-override", str(self.small_blocks)]
        ktc = CONNECTORS[s.connector](url) if s.connector else None
        return cmd + (["--kv-transfer-config", json.dumps(ktc | {"kv_role": "kv_both"})] if ktc else [])

    def _vllm_env(self, s: System) -> dict[str, str]:
        cpus = sorted(os.sched_getaffinity(0))
        return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                    VLLM_CPU_KVCACHE_SPACE="4" if s.big_kv else "1", VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}-{cpus[-1]}")

    def _cache(self, connector: str) -> str:
        if connector == "tierkv":  # the daemon: memory over disk
            port, cfg = free_port(), self.work / "tierkv.toml"
            cfg.write_text(f'[tiers.cpu]\ncapacity = "{int(CACHE_MEMORY_GIB * 1024)}MiB"\n[tiers.disk]\n'
                           f'path = "{self.work}/tierkv-disk"\ncapacity = "20GiB"\n')
            self._spawn([sys.executable, "-m", "engine.cli", "serve", "--config", str(cfg), "--listen",
                         f"127.0.0.1:{port}"], dict(os.environ))
            wait_port(port, self.procs[-1], "tierkv daemon")
            return f"grpc://127.0.0.1:{port}"
        if connector == "lmcache":  # multi-process mode, memory over its fs adapter, as its docs set it up
            port = free_port()
            l2 = json.dumps({"type": "fs", "base_path": str(self.work / "lmcache")})
            self._spawn([str(self.venv_py.parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
                         "--chunk-size", str(VLLM_PAGE), "--l1-size-gb", str(CACHE_MEMORY_GIB), "--no-l1-use-lazy", "--eviction-policy",
                         "LRU", "--supported-transfer-mode", "auto", "--disable-observability", "--http-port",
                         str(free_port()), "--shm-name", f"tierkv-agentic-{os.getpid()}", "--l2-adapter", l2],
                        dict(os.environ))
            wait_port(port, self.procs[-1], "lmcache server")
            return f"127.0.0.1:{port}"
        return "none"

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs.clear()


def _wait_health(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(base + "/health", timeout=5).close()
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{base} not healthy in {timeout:.0f} s")


def slo_baseline(base: str, shape: TraceShape) -> dict[str, float]:
    """Unloaded cold TTFT of a median-context prompt of the trace (a session halfway through, its
    own system prompt so nothing is cached) and unloaded TPOT, on the server at `base`."""
    import openai

    system, sessions = make_trace(shape, 1.0, seed=99)
    s = sessions[0]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": s.task}]
    for t in s.turns[: len(s.turns) // 2]:
        messages += [{"role": "assistant", "content": "Calling the tool."}, {"role": "tool", "content": t.tool_text}]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
    t0, times = time.perf_counter(), []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    ttft, tpot = times[0] - t0, (times[-1] - times[0]) / max(1, len(times) - 1)
    return {"ttft_slo_s": round(ttft, 3), "tpot_slo_s": round(TPOT_SLO_FACTOR * tpot, 4), "cold_ttft_s": round(ttft, 3),
            "unloaded_tpot_s": round(tpot, 4)}


def warm_up(base: str) -> None:
    """One small request: a server's first request pays one-time costs no trace request should."""
    import openai

    openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)


def figures(results: list[Result], slo: dict[str, float]) -> dict[str, float]:
    met = [r for r in results if r.ttft_s <= slo["ttft_slo_s"] and r.tpot_s <= slo["tpot_slo_s"]]
    span = max(r.arrive_s + r.ttft_s for r in results) - min(r.arrive_s for r in results)
    resumed = [r for r in results if r.ideal_tokens]
    ttft = sorted(r.ttft_s for r in results)
    tpot = sorted(r.tpot_s for r in results)
    return {"requests": len(results), "slo_met": len(met) / len(results), "goodput_rps": len(met) / span,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "tpot_p50": statistics.median(tpot), "tpot_p99": tpot[min(len(tpot) - 1, int(0.99 * len(tpot)))],
            "hit_rate": sum(min(r.cached_tokens, r.ideal_tokens) for r in resumed) / max(1, sum(r.ideal_tokens
                                                                                             for r in resumed))}


def run_system(s: System, rates: list[float], shape: TraceShape, work: Path, venv_py: Path, dtype: str,
               model_dir: str, log, slo: dict | None, max_len: int) -> tuple[dict, dict, dict | None]:
    """Start the system once and replay the trace at each rate: the same sessions, in other words at each
    rate (nothing one rate cached helps the next); (figures, results) per rate."""
    run = Run(work / s.name, venv_py, dtype, log, max_len)
    run.work.mkdir(parents=True)
    rows, results = {}, {}
    try:
        base = run.start(s, model_dir)
        warm_up(base)
        slo = slo or slo_baseline(base, shape)
        for k, rate in enumerate(rates):
            system, sessions = make_trace(shape, rate, seed=17, variant=k)
            align = 16 if s.connector == "tierkv" else VLLM_PAGE  # our loads move 16-token blocks, others whole pages
            results[rate] = Replay(base, MODEL, system, align, s.hints).run(sessions)
            rows[rate] = figures(results[rate], slo)
    except RuntimeError as e:
        print(f"{s.name}: did not start ({e}); see {log.name}", flush=True)
    finally:
        run.stop()
    return rows, results, slo


def outputs_agree(results: list[Result], reference: list[Result]) -> float:
    """Share of (session, turn) greedy texts equal to the reference's (vLLM alone at the same rate)."""
    ref = {(r.sid, r.turn): r.text for r in reference}
    both = [(r.text, ref[(r.sid, r.turn)]) for r in results if (r.sid, r.turn) in ref]
    return sum(a == b for a, b in both) / max(1, len(both))


def summary(table: dict[tuple[str, float], dict], rates: list[float], identical: bool | None) -> dict:
    """The issue's figures: ours = vLLM + tierkv with session hints."""
    ok = [r for r in rates if table.get(("vllm", r), {}).get("slo_met", 0) >= 0.5]
    rate = max(ok) if ok else min(rates)

    def get(system: str, key: str) -> float | None:
        row = table.get((system, rate))
        return row[key] if row else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    ours = "vllm_tierkv_hints"
    return {"rate": rate, "goodput_vs_vllm": ratio(get(ours, "goodput_rps"), get("vllm", "goodput_rps")),
            "goodput_vs_lmcache": ratio(get(ours, "goodput_rps"), get("vllm_lmcache", "goodput_rps")),
            "p99_ttft_vs_lmcache": ratio(get(ours, "ttft_p99"), get("vllm_lmcache", "ttft_p99")),
            "hit_rate": round(get(ours, "hit_rate") or 0.0, 3),
            "goodput_vs_upper_bound": ratio(get(ours, "goodput_rps"), get("upper_bound", "goodput_rps")),
            "hints_goodput_gain": ratio(get(ours, "goodput_rps"), get("vllm_tierkv", "goodput_rps")),
            "outputs_identical": identical}


def plot(table: dict[tuple[str, float], dict], rates: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(n for n, _ in table):
        xs = [r for r in rates if (name, r) in table]
        a.plot(xs, [table[(name, r)]["goodput_rps"] for r in xs], marker="o", label=name)
        b.plot(xs, [table[(name, r)]["ttft_p99"] for r in xs], marker="o", label=name)
    a.set(xlabel="session arrivals per second", ylabel="goodput (requests/s within SLO)", title="goodput", ylim=(0, None))
    b.set(xlabel="session arrivals per second", ylabel="P99 TTFT (s)", title="P99 TTFT", ylim=(0, None))
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one rate, 6 sessions of 3-4 turns, 4 systems (about 5 minutes)")
    ap.add_argument("--rates", default=None, help="session arrivals per second, comma-separated")
    ap.add_argument("--systems", default=None, help="comma-separated subset of: " + ", ".join(s.name for s in SYSTEMS))
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="float32 (default): greedy outputs stay equal across prefill splits, so `outputs_identical` "
                         "checks the loaded KV bit for bit; in bfloat16 a cached prefix changes the rounding of what "
                         "is computed after it, and greedy texts drift for LMCache and tierkv alike (71-97%% equal, 2026-12-06)")
    args = ap.parse_args()
    from engine.config import auto_dtype
    from engine.models import resolve_model

    import torch

    dtype = auto_dtype(torch.device("cpu")) if args.dtype == "auto" else args.dtype
    shape, max_len = QUICK if args.quick else FULL["bfloat16" if dtype == "bfloat16" else "float32"]
    rates = [float(r) for r in args.rates.split(",")] if args.rates else ([0.5] if args.quick else FULL_RATES)
    wanted = set(args.systems.split(",")) if args.systems else set(QUICK_SYSTEMS if args.quick else
                                                                   [s.name for s in SYSTEMS])
    wanted.add("vllm")  # the SLOs, the summary's rate and the output check are all vLLM alone's
    venv_py = REPO / os.environ.get("TIERKV_VLLM_VENV", ".venv-vllm") / "bin" / "python"
    work = Path(tempfile.mkdtemp(prefix="agentic-"))
    print(f"cpu: {cpu_line()}; dtype {dtype}; trace {shape}; rates {rates}; work {work}", flush=True)
    table, results, slo = {}, {}, None
    t0 = time.perf_counter()
    with open(work / "servers.log", "w") as log:
        for s in [s for s in SYSTEMS if s.name in wanted]:
            rows, res, slo = run_system(s, rates, shape, work, venv_py, dtype, str(resolve_model(MODEL)), log, slo,
                                        max_len)
            for rate, row in rows.items():
                table[(s.name, rate)], results[(s.name, rate)] = row, res[rate]
                print(f"rate {rate}: {s.name:<20} " + " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in row.items()), flush=True)
    print(f"SLOs (unloaded cold baseline on vLLM alone): {slo}")
    vllm_based = [k for k in results if k[0].startswith("vllm_") and ("vllm", k[1]) in results]
    agree = {k: outputs_agree(results[k], results[("vllm", k[1])]) for k in vllm_based}
    agree.update({k: outputs_agree(results[k], results[("vllm", k[1])]) for k in results
                  if k[0] == "serve_engine_tierkv" and ("vllm", k[1]) in results})
    for k, v in agree.items():
        print(f"outputs equal to vLLM alone's: {k[0]} at {k[1]}: {v:.3f}")
    if args.plot:
        try:
            plot(table, rates, args.plot)
        except ImportError:
            print("--plot needs matplotlib: pip install -e '.[bench]'", file=sys.stderr)
    print(f"took {time.perf_counter() - t0:.0f} s")
    checked = [v for k, v in agree.items() if k[0].startswith("vllm_")]  # none without vLLM alone: no verdict
    print(json.dumps(summary(table, rates, all(v == 1.0 for v in checked) if checked else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

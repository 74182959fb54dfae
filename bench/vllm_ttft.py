"""Time to first token of vLLM (CPU build) with a cached prefix: ours vs peers.

Cases, SmolLM2-135M bf16, one ~2,000-token prompt (random ids), greedy, 1 token:

- cold: vLLM, no connector;
- ours cold: TierKVConnector storing into the tierkv daemon (grpc://) - the save overhead;
- ours warm, memory: a new engine loads from the daemon's memory;
- ours warm, disk: a new engine with an embedded store (local://) on the daemon's
  disk directory, page cache dropped for those files;
- ExampleConnector (vLLM's disk connector): store, then load in a new engine;
- LMCache 0.5.6 multi-process mode (server, chunk 128, shared memory): store,
  then load in a new engine from server memory; full mode also from its disk
  adapter after a server restart.

Every engine gets a short warm-up request before the measured ones. Full
mode starts one process per engine and measures 3 prompts per engine (the
table shows the median and the first; a first request also pays one-time
costs such as first touches of fresh memory, which on this kind of VM cost
as much as the copy itself);
``--quick`` runs the engines one after another in one process (each a fresh
vLLM engine, stores closed and reopened in between; LMCache's in a second
process) with one prompt: the smallest honest version, still about 2 minutes
on 2 busy cores (vLLM's engine init alone is 5-25 s), not under 60 s.

Ratios: ``ours_vs_X_warm`` = X's warm TTFT / ours (> 1: ours is faster);
``cold_overhead`` = ours cold / cold; ``warm_speedup_vs_cold`` = cold / ours
warm (memory). Our load bandwidth is also printed against memcpy measured in
the same run. Last line: one JSON object.

    python bench/vllm_ttft.py [--quick] [--tokens N]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------ child: runs vLLM engines
def _engine_config(kind: str, arg: str):
    from vllm.config import KVTransferConfig

    if kind == "none":
        return None
    if kind == "ours":
        return KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="connectors.vllm",
                                kv_role="kv_both", kv_connector_extra_config={"url": arg})
    if kind == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": arg})
    host, port = arg.rsplit(":", 1)
    return KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                            kv_connector_extra_config={"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": int(port)})


def run_engine(model: str, case: dict, max_model_len: int) -> dict:
    """One fresh vLLM engine: a warm-up request, then TTFT of each prompt."""
    import gc

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=max_model_len,
              kv_transfer_config=_engine_config(case["kind"], case.get("arg", "")))
    init = time.perf_counter() - t0
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=case["warmup"])], one, use_tqdm=False)
    ttft, cached = [], []
    for prompt in case["prompts"]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - t)
        cached.append(out.num_cached_tokens)
    res = {"name": case["name"], "init_s": init, "ttft": ttft, "cached": cached}
    if case["kind"] == "ours":
        from connectors.vllm import connectors_in_process

        w = next(c.worker for c in connectors_in_process() if c.worker is not None)
        res["load_s"], res["bytes_loaded"] = w.stats.load_s, w.stats.bytes_loaded
        src = torch.empty(64 << 20, dtype=torch.uint8).random_()
        dst = torch.empty_like(src).zero_()
        t = time.perf_counter()
        dst.copy_(src)
        res["memcpy_gbs"] = src.numel() / (time.perf_counter() - t) / 1e9
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if case["kind"] == "ours":
        from connectors import vllm as ours

        assert not ours._clients, "the store must be closed between engines (else the next one is not new)"
    return res


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    # in-process engine core, so our connector's counters are readable here; LMCache's connector
    # breaks vLLM's CPU worker init when imported in that process, so it keeps vLLM's default
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if spec["inproc"] else "1"
    results = []
    for case in spec["cases"]:
        if case.get("before"):  # a step the parent asked for between engines (drop page cache)
            _drop_page_cache(case["before"])
        results.append(run_engine(spec["model"], case, spec["max_model_len"]))
        Path(out_path).write_text(json.dumps(results))


def _drop_page_cache(root: str) -> None:
    """posix_fadvise(DONTNEED) every file under root, so the next reads come from the device."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ------------------------------------------------------------------ parent: servers and processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f}s")


class Servers:
    """The tierkv daemon and the LMCache server, started and stopped by the parent."""

    def __init__(self, work: Path, venv_py: Path, log) -> None:
        self.work, self.venv_py, self.log = work, venv_py, log
        self.procs: dict[str, subprocess.Popen] = {}
        self.tierkv_port, self.lmcache_port = _free_port(), _free_port()

    def start_tierkv(self) -> str:
        cfg = self.work / "tierkv.toml"
        cfg.write_text(f'[tiers.cpu]\ncapacity = "2GiB"\n\n[tiers.disk]\npath = "{self.work}/daemon"\n'
                       f'capacity = "20GiB"\nwrite = "through"\n')
        cmd = [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{self.tierkv_port}"]
        self._start("tierkv", cmd, self.tierkv_port)
        return f"grpc://127.0.0.1:{self.tierkv_port}"

    def start_lmcache(self) -> str:
        lm = self.venv_py.parent / "lmcache"
        l2 = json.dumps({"type": "fs", "base_path": str(self.work / "lmcache")})
        cmd = [str(lm), "server", "--host", "127.0.0.1", "--port", str(self.lmcache_port), "--chunk-size", "128",
               "--l1-size-gb", "2", "--no-l1-use-lazy", "--eviction-policy", "LRU", "--supported-transfer-mode",
               "auto", "--disable-observability", "--http-port", str(_free_port()),
               "--shm-name", f"tierkv-bench-{os.getpid()}", "--l2-adapter", l2]
        self._start("lmcache", cmd, self.lmcache_port)
        return f"127.0.0.1:{self.lmcache_port}"

    def _start(self, name: str, cmd: list[str], port: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        self.procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        _wait_port(port, self.procs[name], name)

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def _run_child(venv_py: Path, model: str, cases: list[dict], work: Path, log) -> list[dict]:
    spec, out = work / f"spec-{cases[0]['name']}.json", work / f"out-{cases[0]['name']}.json"
    longest = max(len(p) for p in cases[0]["prompts"])
    spec.write_text(json.dumps({"model": model, "cases": cases, "inproc": cases[0]["kind"] != "lmcache",
                                "max_model_len": max(4096, longest + 64)}))
    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}-{cpus[-1]}")
    res = subprocess.run([str(venv_py), str(Path(__file__).resolve()), "--child", str(spec), str(out)],
                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"vLLM child failed (rc={res.returncode}); see {log.name}")
    return json.loads(out.read_text())


def build_cases(prompts: list[list[int]], work: Path, daemon_url: str | None, lmcache: str | None,
                quick: bool) -> list[dict]:
    rng = random.Random(7)
    cases: list[dict] = []

    def add(name: str, kind: str, arg: str = "", before: str = "") -> None:
        cases.append({"name": name, "kind": kind, "arg": arg, "before": before, "prompts": prompts,
                      "warmup": [rng.randrange(3, 49000) for _ in range(32)]})

    add("cold", "none")
    if daemon_url:
        add("ours_cold_mem", "ours", daemon_url)
        add("ours_warm_mem", "ours", daemon_url)
    ours_dir = f"local://{work}/ours"
    add("ours_cold_disk", "ours", ours_dir)
    add("ours_warm_disk", "ours", ours_dir, before=str(work / "ours"))
    add("example_store", "example", str(work / "example"))
    add("example_warm_disk", "example", str(work / "example"), before=str(work / "example"))
    if lmcache:
        add("lmcache_store", "lmcache", lmcache)
        add("lmcache_warm_mem", "lmcache", lmcache)
        if not quick:
            add("lmcache_warm_disk", "lmcache", lmcache, before=str(work / "lmcache"))
    return cases


def summarize(results: list[dict]) -> dict:
    by = {r["name"]: r for r in results}
    med = {n: statistics.median(r["ttft"]) for n, r in by.items()}
    print(f"{'case':<20} {'init s':>7} {'TTFT s (median)':>16} {'first':>7} {'cached tokens':>14}")
    for n, r in by.items():
        print(f"{n:<20} {r['init_s']:7.1f} {med[n]:16.3f} {r['ttft'][0]:7.3f} {str(r['cached']):>14}")
    ours_mem = med.get("ours_warm_mem", med["ours_warm_disk"])
    ours_cold = med.get("ours_cold_mem", med["ours_cold_disk"])
    out = {
        "ttft_s": {n: round(v, 4) for n, v in med.items()},
        "ours_vs_example_warm": med["example_warm_disk"] / med["ours_warm_disk"],
        "ours_vs_lmcache_warm": med["lmcache_warm_mem"] / ours_mem if "lmcache_warm_mem" in med else None,
        "cold_overhead": ours_cold / med["cold"],
        "warm_speedup_vs_cold": med["cold"] / ours_mem,
    }
    for n in ("ours_warm_mem", "ours_warm_disk"):
        r = by.get(n)
        if r and r.get("load_s"):
            gbs = r["bytes_loaded"] / r["load_s"] / 1e9
            out[f"{n}_load_gbs"] = round(gbs, 3)
            out[f"{n}_load_vs_memcpy"] = round(gbs / r["memcpy_gbs"], 4)
            print(f"{n}: connector load {gbs:.2f} GB/s = {gbs / r['memcpy_gbs']:.3f} x memcpy "
                  f"({r['memcpy_gbs']:.2f} GB/s in the same process)")
    print(f"ours vs ExampleConnector, warm from disk: {out['ours_vs_example_warm']:.2f}x (>1: ours faster)")
    if out["ours_vs_lmcache_warm"] is not None:
        print(f"ours vs LMCache MP, warm from memory:   {out['ours_vs_lmcache_warm']:.2f}x (>1: ours faster)")
    print(f"cold overhead of storing: {out['cold_overhead']:.2f}x; warm speedup vs cold: "
          f"{out['warm_speedup_vs_cold']:.1f}x")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one process, one prompt (see the module docstring)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length (default: %(default)s)")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(*args.child)
        return 0
    t_start = time.perf_counter()
    venv = Path(os.environ.get("TIERKV_VLLM_VENV", ".venv-vllm"))
    venv_py = (venv if venv.is_absolute() else REPO / venv) / "bin" / "python"
    subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh"), "lmcache"], cwd=REPO, check=True)
    from engine.models import resolve_model

    model = str(resolve_model("smollm2"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49000) for _ in range(args.tokens)] for _ in range(1 if args.quick else 3)]
    work = Path(tempfile.mkdtemp(prefix="tierkv-vllm-ttft-"))
    log = open(work / "log.txt", "w")
    servers = Servers(work, venv_py, log)
    results: list[dict] = []
    try:
        daemon_url = lmcache = None
        try:
            daemon_url = servers.start_tierkv()
        except RuntimeError as e:
            print(f"tierkv daemon unavailable ({e}): no 'ours from memory' case", file=sys.stderr)
        try:
            lmcache = servers.start_lmcache()
        except (RuntimeError, OSError) as e:
            print(f"LMCache server unavailable ({e}): no LMCache cases", file=sys.stderr)
        cases = build_cases(prompts, work, daemon_url, lmcache, args.quick)
        if args.quick:  # one process for our and vLLM's connectors, one for LMCache's (see child_main)
            for group in ([c for c in cases if c["kind"] != "lmcache"], [c for c in cases if c["kind"] == "lmcache"]):
                results += _run_child(venv_py, model, group, work, log) if group else []
        else:
            for case in cases:
                if case["name"] == "lmcache_warm_disk":  # a new server: its memory is gone, its disk is not
                    servers.stop("lmcache")
                    servers.start_lmcache()
                results += _run_child(venv_py, model, [case], work, log)
    finally:
        servers.stop_all()
        log.close()
    out = summarize(results)
    out.update(quick=args.quick, prompt_tokens=args.tokens, wall_s=round(time.perf_counter() - t_start, 1),
               log=str(work / "log.txt"))
    print(json.dumps(out))
    for stored in ("ours", "example", "daemon", "lmcache"):  # keep the log, not the ~50 MB stores
        shutil.rmtree(work / stored, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

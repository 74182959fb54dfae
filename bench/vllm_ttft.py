"""Time to first token of vLLM (CPU build) with a cached prefix: ours vs peers.

SmolLM2-135M bf16, a ~2,000-token prompt (random ids), greedy, 1 token:

- cold: vLLM, no connector;
- ours cold / warm, memory: TierKVConnector on the tierkv daemon (grpc://,
  shared memory; a CPU tier prefaulted at start, write-through to disk);
- ours cold / warm, disk: an embedded store (local://), page cache of its
  files dropped before the warm request;
- ExampleConnector (vLLM's disk connector): store, then warm, page cache of
  its files dropped;
- LMCache 0.5.6 multi-process mode (`lmcache server`, chunk 128, shared
  memory, eager L1 of the same size as our CPU tier): store, then warm from
  its memory; full mode also from its disk adapter after a server restart.

Every engine gets a warm-up request first (a process's first one as long
as a document, then the same plus a question, which vLLM's own prefix cache
serves: they build the CPU kernels for a long prefill and for a short query
over a long cached context). Full mode starts a new vLLM process for every
case, once the servers are idle (their background writes to disk done), and
sends 5 documents and the chat: the store engines, a second cold engine,
then ``--rounds`` rounds (default 2) of the warm engines, each round with
new questions and a new turn 5, all in vLLM's default process layout (as
LMCache's connector needs). ``--quick`` runs one engine per connector in one
process, with one document and the chat: the warm request follows a reset
of vLLM's own prefix cache in the same engine, so it can only hit the
connector (our disk engine gets a 1 MiB CPU tier, so its warm request reads
the disk tier); LMCache is skipped unless ``--lmcache`` is given, because
its multi-process engine alone takes 25-30 s to start here.

Ratios (the issue's keys): ``ours_vs_example_warm`` = ours / Example, both
warm from disk; ``ours_vs_lmcache_warm`` = ours / LMCache, both warm from
memory (lower is better, goal <= 1), each on the mean TTFT over the warm
workload (documents and chat resume; ``*_docs`` and ``*_chat`` split it,
``*_rounds`` gives it per round); ``cold_overhead`` = ours cold (daemon) /
cold - 1 (goal <= 0.05; ``cold_save_fraction``, the share of those cold
requests' time a step waited for our saves, is the same question without
the noise of two separate runs; ``cold_save_background_fraction`` is the
saving our connector did meanwhile, in or beside the step, see ``--save``);
``warm_speedup_vs_cold`` = cold / ours warm (memory), with ``*_docs`` and
``*_chat`` as above (the chat resume's ~580 new tokens are computed however
much of the history is cached, which bounds its speedup). Where our connector
runs in the bench's process (cold engines, ``--quick``), its load and save
times and its load bandwidth against a memcpy are printed too. Last line:
one JSON object.

    python bench/vllm_ttft.py [--quick [--lmcache]] [--tokens N] [--rounds N] [--save auto|async|sync]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
L1_GIB = {False: 1.0, True: 0.5}  # by --quick: host memory of our daemon's CPU tier and of LMCache's L1, alike
sys.path.insert(0, str(REPO))
from bench._procs import cpu_line, free_port, smollm2_namespace, wait_idle, wait_port  # noqa: E402


# ------------------------------------------------------------------ parent: servers and processes
class Servers:
    """The tierkv daemon and the LMCache server, started and stopped by the parent."""

    def __init__(self, work: Path, venv_py: Path, log, l1_gib: float, dtype: str) -> None:
        self.work, self.venv_py, self.log, self.l1_gib, self.dtype = work, venv_py, log, l1_gib, dtype
        self.procs: dict[str, subprocess.Popen] = {}
        self.tierkv_port, self.lmcache_port = free_port(), free_port()

    def start_tierkv(self) -> str:
        from cache_service.blocks.objects import object_size

        # SmolLM2-135M's blocks: the pool is sized and prefaulted at start, as LMCache's server
        # allocates its L1 eagerly (--no-l1-use-lazy); measurements wait until that is done
        slot = object_size(smollm2_namespace(self.dtype))
        cfg = self.work / "tierkv.toml"
        cfg.write_text(f'[tiers.cpu]\ncapacity = "{int(self.l1_gib * 1024)}MiB"\nslot_bytes = {slot}\nprefault = true\n\n'
                       f'[tiers.disk]\npath = "{self.work}/daemon"\ncapacity = "20GiB"\nwrite = "through"\n')
        cmd = [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{self.tierkv_port}"]
        self._start("tierkv", cmd, self.tierkv_port)
        wait_idle(self.procs["tierkv"].pid)
        return f"grpc://127.0.0.1:{self.tierkv_port}"

    def start_lmcache(self) -> str:
        lm = self.venv_py.parent / "lmcache"
        l2 = json.dumps({"type": "fs", "base_path": str(self.work / "lmcache")})
        cmd = [str(lm), "server", "--host", "127.0.0.1", "--port", str(self.lmcache_port), "--chunk-size", "128",
               "--l1-size-gb", str(self.l1_gib), "--no-l1-use-lazy", "--eviction-policy", "LRU", "--supported-transfer-mode",
               "auto", "--disable-observability", "--http-port", str(free_port()),
               "--shm-name", f"tierkv-bench-{os.getpid()}", "--l2-adapter", l2]
        self._start("lmcache", cmd, self.lmcache_port)
        wait_idle(self.procs["lmcache"].pid)
        return f"127.0.0.1:{self.lmcache_port}"

    def settle(self) -> None:
        """Wait until every server is idle (its background writes to disk done)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                wait_idle(proc.pid)

    def _start(self, name: str, cmd: list[str], port: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        self.procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(port, self.procs[name], name)

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
    name = cases[0]["phases"][0]["name"]
    spec, out = work / f"spec-{name}.json", work / f"out-{name}.json"
    longest = max(len(p) for p in cases[0]["prompts"]["warm"] + cases[0]["prompts"]["store"])
    inproc = cases[0]["kind"] != "lmcache" and not cases[0].get("default_procs")
    spec.write_text(json.dumps({"model": model, "cases": cases, "inproc": inproc,
                                "max_model_len": max(4096, longest + 64)}))
    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}-{cpus[-1]}")
    res = subprocess.run([str(venv_py), "-m", "bench._vllm_engine", str(spec), str(out)],
                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"vLLM child failed (rc={res.returncode}); see {log.name}")
    return json.loads(out.read_text())


STORE_PHASES = ("ours_cold_mem", "ours_cold_disk", "example_store", "lmcache_store")  # send the "store" prompts


def make_prompts(tokens: int, docs: int, rounds: int = 1) -> dict[str, list]:
    """The issue's two workloads, as token ids (random, so no tokenizer is involved):

    - documents of `tokens` tokens plus a question each; the warm request asks
      a new question about the same document;
    - a chat of 4 earlier turns of tokens/4 each, sent turn by turn (each
      request the whole history so far); the warm request is turn 5, the
      whole history plus a new message, as when a conversation resumes.

    ``store``: what a first engine sends (and its connector saves); ``warm``:
    what the measured engines send (a cold engine computes all of it);
    ``warm1``... the same for later rounds, with new questions and a new turn 5
    (a round's engines save theirs, so the next round cannot reuse them).
    """
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    documents = [ids(tokens) for _ in range(docs)]
    turns = [ids(tokens // 4) for _ in range(5)]
    history = [sum(turns[:k], []) for k in range(1, 6)]
    out = {"store": [d + ids(40) for d in documents] + history[:4], "labels_store": ["doc"] * docs + ["chat"] * 4}
    for r in range(rounds):
        name = "warm" if r == 0 else f"warm{r}"
        out[name] = [d + ids(40) for d in documents] + [history[3] + (turns[4] if r == 0 else ids(tokens // 4))]
        out["labels_" + name] = ["doc"] * docs + ["chat"]
    return out


def build_cases(prompts: dict[str, list], work: Path, daemon_url: str | None, lmcache: str | None,
                quick: bool, rounds: int = 1) -> list[dict]:
    """Engines to run, each with its phases.

    Full mode: one engine (and process) per phase. First every connector's
    store engine (vLLM's process layout as configured in ``child_main``), then
    a second cold engine (no connector), then `rounds` rounds of the warm engines, each round with prompts of its own
    and in turned order, all in vLLM's default process layout (LMCache's
    connector needs it, so everyone gets it), then LMCache from its disk after
    a server restart, once per round. ``quick``: one engine per connector,
    whose warm phase follows a reset of vLLM's prefix cache (and a page-cache
    drop for disks)."""
    rng = random.Random(7)

    def case(kind: str, arg: str, *steps: dict, **extra) -> dict:
        return {"kind": kind, "arg": arg, "phases": list(steps), "prompts": prompts,
                "warmup": [rng.randrange(3, 49000) for _ in range(32)], **extra}

    def step(name: str, before: str = "", reset: bool = False, round_: int = 0) -> dict:
        warm = "warm" if round_ == 0 else f"warm{round_}"
        return {"name": name, "before": before, "reset": reset, "prompts": "store" if name in STORE_PHASES else warm}

    # quick: a 1 MiB CPU tier, so the warm phase in the same engine reads the disk tier
    conns = [("ours", daemon_url, "ours_cold_mem", "ours_warm_mem", "")] if daemon_url else []
    conns += [("ours", f"local://{work}/ours" + ("?cpu=1MiB" if quick else ""), "ours_cold_disk", "ours_warm_disk",
               str(work / "ours")),
              ("example", str(work / "example"), "example_store", "example_warm_disk", str(work / "example"))]
    conns += [("lmcache", lmcache, "lmcache_store", "lmcache_warm_mem", "")] if lmcache else []
    cases = [case("none", "", step("cold"))]
    if quick:
        return cases + [case(k, arg, step(store), step(warm, before, reset=True)) for k, arg, store, warm, before in conns]
    cases += [case(k, arg, step(store)) for k, arg, store, _, _ in conns]
    # vLLM alone again after the stores: the cold figure spans the same stretch of machine time they do
    if rounds > 1:
        cases.append(case("none", "", step("cold", round_=1)))
    pairs = sorted(conns, key=lambda c: ("disk" in c[3], c[0] != "ours"))  # ours next to the peer it is held to
    for r in range(rounds):
        for k, arg, _, warm, before in (pairs if r % 2 == 0 else pairs[::-1]):
            cases.append(case(k, arg, step(warm, before, round_=r), default_procs=True))
    if lmcache:
        cases += [case("lmcache", lmcache, step("lmcache_warm_disk", str(work / "lmcache"), round_=r))
                  for r in range(rounds)]
    return cases


def summarize(results: list[dict]) -> dict:
    by: dict[str, dict] = {}
    for r in results:  # a case run in several rounds: its requests pooled
        if r["name"] in by:
            for k in ("ttft", "cached", "labels"):
                by[r["name"]][k] = by[r["name"]][k] + r[k]
        else:
            by[r["name"]] = dict(r)

    def of(r: dict, label: str) -> list[float]:
        return [t for t, lab in zip(r["ttft"], r["labels"]) if lab == label]

    # a store phase's chat turns mostly hit vLLM's own cache: its figure is its documents (first sight)
    med = {n: statistics.median(of(r, "doc") if r["labels"].count("chat") > 1 else r["ttft"])
           for n, r in by.items()}
    doc = {n: statistics.median(of(r, "doc")) for n, r in by.items()}
    print(f"{'case':<18} {'init s':>6} {'TTFT s':>7} {'docs':>7} {'chat':>7} {'our save s':>10} {'in step':>7}  "
          "cached tokens")
    # a store phase's figure is its last turn; a warm phase's the mean over its rounds' resumes
    chat = {n: of(r, "chat")[-1] if n in STORE_PHASES else statistics.fmean(of(r, "chat")) for n, r in by.items()}
    for n, r in by.items():
        save = f"{r['save_s']:10.3f} {r['save_wait_s']:7.3f}" if "save_s" in r else f"{'':>18}"
        print(f"{n:<18} {r['init_s']:6.1f} {med[n]:7.3f} {doc[n]:7.3f} {chat[n]:7.3f} {save}  {r['cached']}")
    # warm figures: the mean over the workload (its documents and the chat resume), as a user waits for all of it
    mean = {n: statistics.fmean(r["ttft"]) for n, r in by.items()}
    mine = {"example": "ours_warm_disk", "lmcache": "ours_warm_mem"}
    theirs = {"example": "example_warm_disk", "lmcache": "lmcache_warm_mem"}
    ours_mem = mean.get("ours_warm_mem", mean["ours_warm_disk"])
    out = {"ttft_s": {n: round(v, 4) for n, v in med.items()}}
    for peer in ("example", "lmcache"):
        a, b = mine[peer], theirs[peer]
        present = b in by and a in by
        out[f"ours_vs_{peer}_warm"] = mean[a] / mean[b] if present else None
        out[f"ours_vs_{peer}_warm_docs"] = doc[a] / doc[b] if present else None
        out[f"ours_vs_{peer}_warm_chat"] = chat[a] / chat[b] if present else None
        rounds = zip([r for r in results if r["name"] == a], [r for r in results if r["name"] == b])
        out[f"ours_vs_{peer}_warm_rounds"] = [round(statistics.fmean(x["ttft"]) / statistics.fmean(y["ttft"]), 3)
                                              for x, y in rounds]
    out["cold_overhead"] = doc.get("ours_cold_mem", doc["ours_cold_disk"]) / doc["cold"] - 1.0
    out["warm_speedup_vs_cold"] = mean["cold"] / ours_mem
    # split as the ratios are: the chat resume computes its ~580 new tokens whatever the cache does
    mem = "ours_warm_mem" if "ours_warm_mem" in by else "ours_warm_disk"
    out["warm_speedup_vs_cold_docs"] = doc["cold"] / doc[mem]
    out["warm_speedup_vs_cold_chat"] = chat["cold"] / chat[mem]
    # the part of the cold requests' time a step waited for our saves (less noisy than two TTFTs' ratio),
    # and the saving done meanwhile on the connector's save thread
    stored = by.get("ours_cold_mem", by["ours_cold_disk"])
    out["cold_save_fraction"] = stored["save_wait_s"] / sum(stored["ttft"])
    out["cold_save_background_fraction"] = stored["save_s"] / sum(stored["ttft"])
    for n in ("ours_warm_mem", "ours_warm_disk"):
        r = by.get(n)
        if r and r.get("load_s"):
            gbs = r["bytes_loaded"] / r["load_s"] / 1e9
            out[f"{n}_load_gbs"] = round(gbs, 3)
            out[f"{n}_load_vs_memcpy"] = round(gbs / r["memcpy_gbs"], 4)
            print(f"{n}: connector load {gbs:.2f} GB/s = {gbs / r['memcpy_gbs']:.3f} x memcpy "
                  f"({r['memcpy_gbs']:.2f} GB/s in the same process)")
    for peer, what in (("example", "ExampleConnector, warm from disk"), ("lmcache", "LMCache MP, warm from memory")):
        if out[f"ours_vs_{peer}_warm"] is not None:
            print(f"ours / {what}: {out[f'ours_vs_{peer}_warm']:.2f} (goal <= 1; documents "
                  f"{out[f'ours_vs_{peer}_warm_docs']:.2f}, chat resume {out[f'ours_vs_{peer}_warm_chat']:.2f})")
    print(f"steps waited for our saves {out['cold_save_fraction']:.1%} of the cold requests' time (saving itself "
          f"took {out['cold_save_background_fraction']:.1%} of it)")
    print(f"cold overhead of storing: {out['cold_overhead']:+.1%} (goal <= +5%); warm speedup vs cold: "
          f"{out['warm_speedup_vs_cold']:.1f}x (documents {out['warm_speedup_vs_cold_docs']:.1f}x, "
          f"chat resume {out['warm_speedup_vs_cold_chat']:.1f}x)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one engine per connector, one prompt, no LMCache "
                    "(see the module docstring)")
    ap.add_argument("--lmcache", action="store_true", help="with --quick: run the LMCache case too (~40 s more)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default: 2000; --quick: 512, which "
                    "keeps it under a minute on 2 AVX2 cores in float32)")
    ap.add_argument("--rounds", type=int, default=2, help="full mode: rounds of the warm engines (default: "
                    "%(default)s)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="vLLM's dtype for "
                    "every engine (auto: bfloat16 where the CPU computes it natively, AVX512-BF16 or AMX, else "
                    "float32, where vLLM's bfloat16 is emulated and a 2k-token prefill takes ~25 s; default: %(default)s)")
    ap.add_argument("--save", choices=("auto", "async", "sync"), default="auto", help="our connector's "
                    "async_save (auto: in the step on CPU, in the background on GPU; default: %(default)s)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    venv = Path(os.environ.get("TIERKV_VLLM_VENV", ".venv-vllm"))
    venv_py = (venv if venv.is_absolute() else REPO / venv) / "bin" / "python"
    subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh"), "lmcache"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    import torch

    from engine.config import auto_dtype
    from engine.models import resolve_model

    model = str(resolve_model("smollm2"))
    rounds = 1 if args.quick else args.rounds
    args.tokens = args.tokens or (512 if args.quick else 2000)
    prompts = make_prompts(args.tokens, 1 if args.quick else 5, rounds)
    work = Path(tempfile.mkdtemp(prefix="tierkv-vllm-ttft-"))
    log = open(work / "log.txt", "w")
    dtype = auto_dtype(torch.device("cpu")) if args.dtype == "auto" else args.dtype
    print(f"cpu: {cpu_line()}; dtype {dtype}", flush=True)
    servers = Servers(work, venv_py, log, L1_GIB[args.quick], dtype)
    results: list[dict] = []
    try:
        daemon_url = lmcache = None
        try:
            daemon_url = servers.start_tierkv()
        except RuntimeError as e:
            print(f"tierkv daemon unavailable ({e}): no 'ours from memory' case", file=sys.stderr)
        try:
            lmcache = servers.start_lmcache() if args.lmcache or not args.quick else None
        except (RuntimeError, OSError) as e:
            print(f"LMCache server unavailable ({e}): no LMCache cases", file=sys.stderr)
        cases = build_cases(prompts, work, daemon_url, lmcache, args.quick, rounds)
        for case in cases:
            case["save"], case["dtype"] = args.save, dtype
        if args.quick:  # one process for our and vLLM's connectors, one for LMCache's (see child_main)
            for group in ([c for c in cases if c["kind"] != "lmcache"], [c for c in cases if c["kind"] == "lmcache"]):
                results += _run_child(venv_py, model, group, work, log) if group else []
        else:
            for case in cases:
                if case["phases"][0]["name"] == "lmcache_warm_disk":  # a new server: its memory is gone, its disk is not
                    servers.stop("lmcache")
                    servers.start_lmcache()
                servers.settle()  # a resumed conversation comes after the servers' background writes, not during
                results += _run_child(venv_py, model, [case], work, log)
    finally:
        servers.stop_all()
        log.close()
    out = summarize(results)
    if "lmcache_warm_mem" not in out["ttft_s"]:
        out["lmcache"] = "not run: --quick without --lmcache" if args.quick and not args.lmcache else "unavailable"
    out.update(quick=args.quick, dtype=dtype, rounds=rounds, save=args.save, prompt_tokens=args.tokens, wall_s=round(time.perf_counter() - t_start, 1),
               log=str(work / "log.txt"))
    print(json.dumps(out))
    for stored in ("ours", "example", "daemon", "lmcache"):  # keep the log, not the ~50 MB stores
        shutil.rmtree(work / stored, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a vLLM request's cache time goes: the connector's phases, timed one by one.

vLLM itself is not run: the phases around its step are, on pages of
SmolLM2-135M's shape (30 layers, 3 KV heads of 64, vLLM's CPU pages of 128
tokens; bf16 where the CPU computes it natively, else float32, as
bench/vllm_ttft.py's engines run) packed as vLLM's CPU attention packs them on this machine
(AMX tiles where the CPU has AMX, else the "vec" K-transposed packing;
`--packing` overrides), against a tierkv daemon started as
bench/vllm_ttft.py starts it (a prefaulted shared CPU tier over a disk tier,
write-through or write-back). For a request of `--tokens` tokens:

- save: `read` (vLLM's pages -> canonical blocks, in the step), `store`
  (the blocks into the daemon: copy and hash into its pool slots, commit);
- load: `lookup` (the scheduler side's question: how many of the blocks are
  held), `load` (the daemon's LoadShm into our segment), `write` (canonical
  blocks -> vLLM's pages);
- the daemon's CPU seconds for a save, in and after the call (its writes to
  disk included): what it takes from an engine sharing the cores.

Each phase is also given as a ratio to a memcpy of the same bytes in this
process. Last line: one JSON object (phase medians in ms and ratios, per
write mode).

    python bench/vllm_phases.py [--quick] [--tokens N] [--packing amx|k_transposed] [--dtype auto|bfloat16|float32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench._procs import cpu_seconds, free_port, smollm2_namespace, wait_idle, wait_port  # noqa: E402
from cache_service.blocks.keys import Namespace, prefix_hashes  # noqa: E402
from cache_service.blocks.objects import object_size  # noqa: E402
from connectors.client import connect  # noqa: E402
from connectors.vllm.pages import CpuPageLayout, PagedKV  # noqa: E402
from tests.connectors.vllm.oracle import cpu_index  # noqa: E402

PAGE = 128


def start_daemon(work: Path, write: str, ns: Namespace) -> tuple[subprocess.Popen, str]:
    cfg = work / f"{write}.toml"
    cfg.write_text(f'[tiers.cpu]\ncapacity = "512MiB"\nslot_bytes = {object_size(ns)}\nprefault = true\n\n'
                   f'[tiers.disk]\npath = "{work}/{write}"\ncapacity = "20GiB"\nwrite = "{write}"\n')
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from engine.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(work / f"{write}.log", "w"), stderr=subprocess.STDOUT)
    wait_port(port, proc, "tierkv")
    wait_idle(proc.pid)
    return proc, f"grpc://127.0.0.1:{port}"


def pages_of(packing: str, n_pages: int, ns: Namespace) -> PagedKV:
    layout = CpuPageLayout(cpu_index(packing, PAGE, ns.head_dim))
    gen = torch.Generator().manual_seed(1)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(n_pages + 4, ns.kv_heads, PAGE, 2 * ns.head_dim,
                                                               generator=gen).to(getattr(torch, ns.kv_dtype))
              for i in range(ns.num_layers)}
    kv = PagedKV(caches, ns.kv_heads, ns.head_dim, PAGE, layout)
    kv.reserve(n_pages * PAGE)
    return kv


def one_request(kv: PagedKV, client, ns: Namespace, tokens: list[int], pages: list[int],
                daemon_pid: int) -> dict[str, float]:
    """The four phases of one new prompt: saved, then (after the daemon is idle) loaded back."""
    times, hashes = {}, prefix_hashes(ns, tokens)
    cpu0 = cpu_seconds(daemon_pid)
    t0 = time.perf_counter()
    blocks = kv.read_blocks(pages, ns.block_tokens)
    t1 = time.perf_counter()
    client.store(ns, hashes, list(blocks))
    t2 = time.perf_counter()
    times["read"], times["store"] = t1 - t0, t2 - t1
    wait_idle(daemon_pid)  # the daemon's background writes done, as before a later request
    times["daemon_cpu"] = cpu_seconds(daemon_pid) - cpu0  # all it spent on the save, in and after the call
    t0 = time.perf_counter()
    assert client.lookup(hashes) == len(hashes)  # the scheduler side's question, as a later request asks it
    times["lookup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = client.load(ns, hashes)
    t1 = time.perf_counter()
    kv.write_blocks(got, pages)
    t2 = time.perf_counter()
    assert all(g is not None for g in got)
    times["load"], times["write"] = t1 - t0, t2 - t1
    return times


def memcpy_s(nbytes: int, reps: int = 7) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 requests per write mode (default 7)")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens, whole pages (default: %(default)s)")
    ap.add_argument("--packing", choices=("amx", "k_transposed"), default=None,
                    help="vLLM's CPU page packing (default: amx where the CPU has AMX, else k_transposed)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="the pages' dtype (auto: as bench/vllm_ttft.py picks it for this CPU)")
    args = ap.parse_args()
    from engine.config import auto_dtype

    ns = smollm2_namespace(auto_dtype(torch.device("cpu")) if args.dtype == "auto" else args.dtype)
    packing = args.packing or ("amx" if torch.cpu._is_amx_tile_supported() else "k_transposed")
    n_pages = args.tokens // PAGE
    kv, pages = pages_of(packing, n_pages, ns), list(range(2, 2 + n_pages))
    nbytes = n_pages * PAGE // ns.block_tokens * ns.payload_bytes
    copy_s = memcpy_s(nbytes)
    out: dict = {"packing": packing, "dtype": ns.kv_dtype, "tokens": n_pages * PAGE, "mib": round(nbytes / 2**20, 1),
                 "memcpy_ms": round(copy_s * 1e3, 2)}
    work = Path(tempfile.mkdtemp(prefix="tierkv-phases-"))
    for write in ("through", "back"):
        proc, url = start_daemon(work, write, ns)
        client = connect(url)
        try:
            runs = [one_request(kv, client, ns, list(range(r * 10**6, r * 10**6 + n_pages * PAGE)), pages, proc.pid)
                    for r in range(1 + (3 if args.quick else 7))][1:]  # the first warms both ends up
        finally:
            client.close()
            proc.kill()
            proc.wait()
        for phase in ("read", "store", "lookup", "load", "write", "daemon_cpu"):
            out[f"{write}_{phase}_ms"] = round(statistics.median(r[phase] for r in runs) * 1e3, 2)
        for phase in ("read", "store", "load", "write"):  # the phases that move the bytes
            out[f"{write}_{phase}_vs_memcpy"] = round(copy_s * 1e3 / out[f"{write}_{phase}_ms"], 3)
        print(f"write-{write}: " + ", ".join(f"{p} {out[f'{write}_{p}_ms']:.1f} ms "
                                             f"({out[f'{write}_{p}_vs_memcpy']:.2f} x memcpy)"
                                             for p in ("read", "store", "load", "write"))
              + f"; lookup {out[f'{write}_lookup_ms']:.2f} ms; the daemon's CPU for the save "
              f"{out[f'{write}_daemon_cpu_ms']:.0f} ms")
    print(f"{out['mib']} MiB of KV ({out['tokens']} tokens, {packing} pages of {ns.kv_dtype}); memcpy {out['memcpy_ms']} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The child side of bench/vllm_ttft.py: runs vLLM engines in the vLLM venv.

    <vllm venv>/bin/python -m bench._vllm_engine SPEC.json OUT.json

SPEC (written by the parent): ``model``, ``cases`` (engines with their
phases and prompts), ``inproc`` (vLLM's engine core in this process, so our
connector's counters are readable here), ``max_model_len``. OUT: per phase,
the TTFT and cached tokens of every prompt, and our connector's load and
save figures where it runs in this process.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench._procs import drop_page_cache

SAVE_MODES = {"auto": "auto", "async": True, "sync": False}  # --save -> our connector's async_save

def _engine_config(kind: str, arg: str, save: str = "auto"):
    from vllm.config import KVTransferConfig

    if kind == "none":
        return None
    if kind == "ours":
        return KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="connectors.vllm",
                                kv_role="kv_both",
                                kv_connector_extra_config={"url": arg, "async_save": SAVE_MODES[save]})
    if kind == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": arg})
    host, port = arg.rsplit(":", 1)
    return KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                            kv_connector_extra_config={"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": int(port)})


def run_engine(model: str, case: dict, max_model_len: int) -> list[dict]:
    """One fresh vLLM engine: a warm-up request, then its phases in order,
    each the TTFT of every prompt. A phase may first flush and drop the page
    cache of a directory (``before``) and reset vLLM's own prefix cache
    (``reset``), so its prompts can only hit the connector's store."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=case.get("dtype", "bfloat16"), enforce_eager=True, seed=0, max_model_len=max_model_len,
              kv_transfer_config=_engine_config(case["kind"], case.get("arg", ""), case.get("save", "auto")))
    init = time.perf_counter() - t0
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=case["warmup"])], one, use_tqdm=False)
    if len(case["warmup"]) > 256:  # and a short query over that long cached context, the warm requests' shape
        llm.generate([TokensPrompt(prompt_token_ids=case["warmup"] + case["warmup"][:40])], one, use_tqdm=False)
    results = []
    ours_here = case["kind"] == "ours" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # our worker's in here
    for phase in case["phases"]:
        if ours_here:
            _finish_our_saves(llm)  # the previous phase's saves are in the store before this one asks for them
        if phase.get("before"):
            _flush_our_stores()
            drop_page_cache(phase["before"])
        if phase.get("reset"):
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        loaded = _our_load_stats() if ours_here else None
        ttft, cached = [], []
        for prompt in case["prompts"][phase["prompts"]]:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)[0]
            ttft.append(time.perf_counter() - t)
            cached.append(out.num_cached_tokens)
        res = {"name": phase["name"], "init_s": init, "ttft": ttft, "cached": cached,
               "labels": case["prompts"]["labels_" + phase["prompts"]]}
        if loaded is not None:
            now = _our_load_stats()
            res.update({k: now[k] - loaded[k] for k in now}, memcpy_gbs=_memcpy_gbs())
        results.append(res)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if ours_here:
        from connectors.vllm import clients as vllm_clients

        assert not vllm_clients._clients, "the store must be closed between engines (else the next one is not new)"
    return results


def _our_load_stats() -> dict[str, float]:
    """Our worker's cumulative load and save figures."""
    from connectors.vllm.connector import connectors_in_process

    w = next(c.worker for c in connectors_in_process() if c.worker is not None).stats
    return {"load_s": w.load_s, "bytes_loaded": w.bytes_loaded, "save_s": w.save_s, "bytes_saved": w.bytes_saved,
            "save_wait_s": w.save_wait_s}


def _finish_our_saves(llm) -> None:
    """Our queued saves done, and vLLM told so: it frees the pages of the
    requests it kept for them (else it refuses to reset its prefix cache)."""
    from connectors.vllm.connector import connectors_in_process

    for c in connectors_in_process():
        if c.worker is not None and c.worker.saves is not None:
            assert c.worker.saves.wait(timeout_s=60), "our saves did not finish within 60 s"
    core = llm.llm_engine.engine_core.engine_core  # in-process (see child_main): step it to hear get_finished
    for _ in range(5):
        if not core.scheduler.requests:
            break
        core.step()


def _flush_our_stores() -> None:
    """Background disk writes of our embedded store done, so the page cache drop covers them."""
    from connectors.vllm.connector import connectors_in_process

    for c in connectors_in_process():
        if hasattr(c.client, "flush"):
            assert c.client.flush(60.0), "our store did not flush within 60 s"


def _memcpy_gbs() -> float:
    import torch

    src = torch.empty(64 << 20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src).zero_()
    t = time.perf_counter()
    dst.copy_(src)
    return src.numel() / (time.perf_counter() - t) / 1e9


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    # in-process engine core, so our connector's counters are readable here; LMCache's connector
    # breaks vLLM's CPU worker init when imported in that process, so it keeps vLLM's default
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if spec["inproc"] else "1"
    results = []
    for i, case in enumerate(spec["cases"]):
        if i == 0:  # the process's first long prefill also builds its CPU kernels for those shapes: not measured
            case = {**case, "warmup": case["warmup"] * (len(case["prompts"]["warm"][0]) // len(case["warmup"]))}
        results += run_engine(spec["model"], case, spec["max_model_len"])
        Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])

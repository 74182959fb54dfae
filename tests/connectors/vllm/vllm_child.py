"""Child process of the vLLM tests: one vLLM engine, greedy requests in order.

    <vllm venv>/bin/python -m tests.connectors.vllm.vllm_child SPEC.json OUT_DIR

SPEC keys: ``model`` (dir), ``url``, ``dtype``, ``requests`` (list of
``{"name", "prompt": [ids], "max_tokens"}``), optional ``bad_extra`` (an extra
config that must fail startup first), optional ``held`` (``{name: [ids]}``:
report how many blocks of these prompts the store holds at the end), optional
``extra`` (more ``kv_connector_extra_config`` keys).

Writes ``OUT_DIR/result.json`` (per request: output ids, num_cached_tokens,
deltas of the connector's and the store's counters; the namespace) and
``OUT_DIR/kv.pt`` (the probe's page reads, per request). The engine core runs
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connectors are
reachable, unless the spec says ``"inproc": false``: then vLLM runs as it does
by default (engine core and CPU worker in processes of their own) and only
outputs and ``num_cached_tokens`` are reported.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _make_llm(spec: dict, extra: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    name, module = ("ProbeTierKV", "tests.connectors.vllm.kv_probe") if spec.get("inproc", True) else \
        ("TierKVConnector", "connectors.vllm")
    ktc = KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                           kv_role="kv_both", kv_connector_extra_config=extra)
    return LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True, seed=0,
               kv_transfer_config=ktc, max_model_len=spec.get("max_model_len", 2048), enable_prefix_caching=True)


def _sides():
    from connectors.vllm.connector import connectors_in_process

    found = {c.role.name.lower(): c for c in connectors_in_process() if not c._closed}
    return found["scheduler"], found["worker"]


def _counters(sched, worker) -> dict:
    from connectors.vllm.connector import _as_dict

    if worker.worker.saves is not None:  # the finished request's saves run in the background
        assert worker.worker.saves.wait(timeout_s=60), "saves did not finish within 60 s"
    return {"scheduler": _as_dict(sched.scheduler.stats), "worker": _as_dict(worker.worker.stats),
            "store": sched.client.stats()}


def _delta(after: dict, before: dict) -> dict:
    if isinstance(after, dict):
        return {k: _delta(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()}
    return after - before


def main(spec_path: str, out_dir: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if json.loads(Path(spec_path).read_text()).get(
        "inproc", True) else "1"
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from cache_service.blocks.keys import prefix_hashes

    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    if not spec.get("inproc", True):
        return _main_default_processes(spec, out)
    result: dict = {"requests": {}}
    if spec.get("bad_extra") is not None:
        try:
            _make_llm(spec, spec["bad_extra"])
            result["bad_config_error"] = None
        except Exception as e:  # the startup failure under test
            result["bad_config_error"] = f"{type(e).__name__}: {e}"
    t0 = time.perf_counter()
    llm = _make_llm(spec, {"url": spec["url"], **spec.get("extra", {})})
    result["init_s"] = time.perf_counter() - t0
    sched, worker = _sides()
    result["namespace"] = sched.ns.canonical().decode()
    result["worker_namespace"] = worker.ns.canonical().decode()
    kv = {}
    for req in spec["requests"]:
        before = _counters(sched, worker)
        worker.records.clear()
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params, use_tqdm=False)[0]
        result["requests"][req["name"]] = {
            "output": list(res.outputs[0].token_ids), "num_cached_tokens": res.num_cached_tokens,
            "seconds": time.perf_counter() - t, "delta": _delta(_counters(sched, worker), before),
        }
        kv[req["name"]] = list(worker.records)
    result["requests_left"] = _requests_left(llm)
    result["held"] = {name: sched.client.lookup(prefix_hashes(sched.ns, ids))
                      for name, ids in spec.get("held", {}).items()}
    torch.save(kv, out / "kv.pt")
    (out / "result.json").write_text(json.dumps(result, indent=1))


def _requests_left(llm) -> int:
    """Finished requests vLLM still holds pages for after a few more steps: our
    saves are done, so `get_finished` must have released every one."""
    core = llm.llm_engine.engine_core.engine_core
    for _ in range(5):
        if not core.scheduler.requests:
            break
        core.step()
    return len(core.scheduler.requests)


def _main_default_processes(spec: dict, out: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _make_llm(spec, {"url": spec["url"]})
    result: dict = {"requests": {}}
    for req in spec["requests"]:
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        res = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], params, use_tqdm=False)[0]
        result["requests"][req["name"]] = {"output": list(res.outputs[0].token_ids),
                                           "num_cached_tokens": res.num_cached_tokens}
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

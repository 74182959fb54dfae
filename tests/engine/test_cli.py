"""`tierkv` CLI: clear one-line errors and non-zero exits on bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_unknown_model_is_a_one_line_error():
    r = run("generate", "--model", "no-such-model", "--prompt", "hi", "--kv-connector", "none")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no-such-model" in r.stderr


def test_unreadable_prompt_file_is_a_one_line_error(tmp_path):
    r = run("generate", "--model", "tiny-random", "--prompt-file", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "cannot read prompt file" in r.stderr and r.stderr.count("\n") == 1


def test_prompt_longer_than_the_context_is_a_one_line_error(tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("word " * 100_000)
    r = run("generate", "--model", "tiny-random", "--prompt-file", str(f), "--kv-connector", "none")
    assert r.returncode == 2 and "max_model_len" in r.stderr and r.stderr.count("\n") == 1


def test_human_output_has_the_answer_and_a_summary(tmp_path):
    r = run("generate", "--model", "tiny-random", "--prompt", "hello there", "--max-tokens", "4",
            "--kv-connector", f"local://{tmp_path}")
    assert r.returncode == 0 and r.stdout.strip() and "[tierkv] prompt" in r.stderr


def test_chat_session_resumes_its_kv_in_later_processes(tmp_path):
    # two chat turns in one process, typed on stdin
    env = dict(os.environ, OMP_NUM_THREADS="1")
    url = f"local://{tmp_path}/store"
    chat = subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--model", "tiny-random", "--session", "s1",
                           "--kv-connector", url, "--max-tokens", "8"], input="hello there\nand what next?\n",
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert chat.stderr.count("[tierkv] prompt") == 2
    # a later process continues the session: the earlier turns' KV is loaded, not recomputed
    r = run("generate", "--model", "tiny-random", "--session", "s1", "--prompt", "one more question",
            "--kv-connector", url, "--max-tokens", "4", "--json")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["cached_tokens"] >= 32
    assert out["prompt_tokens"] > out["cached_tokens"]


def test_a_session_continued_with_other_blocks_records_them(tmp_path):
    # a session started with 16-token blocks and continued with 32: its manifest names the 32-token namespace
    # and block size together, so a resume (a daemon's, a pin) finds the blocks the last turn stored
    from cache_service.sessions.manifests import SessionManager
    from connectors.client import connect, session_manifests
    from engine import LLM

    url = f"local://{tmp_path}/store"
    for bt, prompt in ((16, "Tell me a long story about a robot who learns to paint, please."), (32, "and then?")):
        r = run("generate", "--model", "tiny-random", "--dtype", "float32", "--kv-connector", url, "--session", "s1",
                "--block-tokens", str(bt), "--max-tokens", "8", "--prompt", prompt, "--json")
        assert r.returncode == 0, r.stderr
    client = connect(url)
    manifests = session_manifests(url, None, client)
    ns32 = LLM("tiny-random", dtype="float32", num_pages=64).kv_namespace(32)
    s = manifests.get("s1")
    assert s.block_tokens == 32 and s.namespace == ns32.fingerprint().hex()
    assert SessionManager(client, manifests).resume("", "s1", ns32)[1] >= 1
    client.close()


def test_a_turn_saved_by_another_process_during_a_chat_is_kept(tmp_path):
    from cache_service.sessions.manifests import SessionStore

    env = dict(os.environ, OMP_NUM_THREADS="1")
    url = f"local://{tmp_path}/store"
    # A chat takes its first turn...
    chat = subprocess.Popen([sys.executable, "-m", "engine.cli", "chat", "--model", "tiny-random", "--session", "s1",
                             "--kv-connector", url, "--max-tokens", "4"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    chat.stdin.write("turn one\n")
    chat.stdin.flush()
    while "[tierkv] prompt" not in chat.stderr.readline():
        pass
    # ...another process adds a turn to the same session meanwhile...
    assert run("generate", "--model", "tiny-random", "--session", "s1", "--prompt", "turn two from B",
               "--kv-connector", url, "--max-tokens", "4").returncode == 0
    # ...and the chat's next turn continues from it instead of writing over it.
    chat.communicate("turn three from A\n", timeout=300)
    said = [m["content"] for m in SessionStore(tmp_path / "store").get("s1").messages if m["role"] == "user"]
    assert said == ["turn one", "turn two from B", "turn three from A"]


def test_raw_cannot_continue_a_session(tmp_path):
    r = run("generate", "--model", "tiny-random", "--session", "s1", "--raw", "--prompt", "hi",
            "--kv-connector", f"local://{tmp_path}")
    assert r.returncode == 2 and "--raw cannot continue a session" in r.stderr

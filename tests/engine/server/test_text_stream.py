"""Output text as it is generated: deltas add up to the decoded output, stop strings cut it."""
from __future__ import annotations

import pytest

from engine.models import resolve_model
from engine.server.text_stream import TextStream


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2")), local_files_only=True)


def feed_one_by_one(stream: TextStream, ids: list[int]) -> list[str]:
    deltas = [stream.feed([t]) for t in ids[:-1]]
    return deltas + [stream.feed(ids[-1:], final=True)]


def test_deltas_add_up_to_the_text_even_through_multibyte_characters(tokenizer):
    # A text whose characters span several byte-level tokens each.
    text = "Grüße aus Köln: 東京タワー 🚀 and back."
    ids = tokenizer.encode(text)
    deltas = feed_one_by_one(TextStream(tokenizer), ids)
    # No delta carries a broken character, and together they are the text.
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("min_tokens", range(0, 10))
def test_a_stop_string_within_the_first_min_tokens_does_not_end_the_output(tokenizer, min_tokens):
    # "9 1" first ends within the text of ids[:k]; whatever min_tokens is, the output is cut before the
    # stop string or not at all: never inside it.
    ids = tokenizer.encode(" 9 10 11 12 13")  # one token per digit and space
    stream = TextStream(tokenizer, stop=["9 1"], min_tokens=min_tokens)
    text = "".join(feed_one_by_one(stream, ids))
    k = next(n for n in range(len(ids) + 1) if "9 1" in tokenizer.decode(ids[:n]))
    whole = tokenizer.decode(ids)
    if min_tokens < k:
        assert stream.stopped and text == whole[:whole.index("9 1")]
    else:
        assert not stream.stopped and text == whole


def test_a_stop_string_ends_the_output_before_it_even_across_tokens(tokenizer):
    ids = tokenizer.encode("First line. Second line. END of it all")
    stream = TextStream(tokenizer, stop=["END of", "zzz"])
    deltas = feed_one_by_one(stream, ids)
    # The text released stops before the stop string, none of which was ever released.
    assert "".join(deltas) == "First line. Second line. "
    assert stream.stopped
    # Tokens after the stop add nothing.
    assert stream.feed(tokenizer.encode(" more")) == ""


def test_each_token_decodes_a_few_ids_not_the_whole_output(tokenizer):
    # Count the ids the stream asks the tokenizer to decode over a 2,000-token answer.
    decoded = []

    class Counting:
        all_special_ids = tokenizer.all_special_ids

        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kw)
    # 2,000 words, then a run of EOS (what an ignore_eos benchmark makes)
    ids = tokenizer.encode("word " * 2000)[:2000] + [tokenizer.eos_token_id] * 2000
    stream = TextStream(Counting())
    deltas = [stream.feed([t]) for t in ids]
    # The text is whole, and the work per token is bounded (decoding all ids each time was 2M ids).
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(decoded) < 20 * len(ids)


def test_a_window_of_special_tokens_keeps_the_space_of_a_metaspace_tokenizers_next_word():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A SentencePiece-style (Metaspace: Llama, Mistral) tokenizer, whose decoder drops a text's first space.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "▁Hello": 4, "▁world": 5, "!": 6}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    # A word, more special tokens than the stream's context window, then the next word.
    ids = [4] + [3] * 8 + [5, 6]
    stream = TextStream(tok)
    text = "".join(stream.feed([t], final=k == len(ids) - 1) for k, t in enumerate(ids))
    assert text == tok.decode(ids, skip_special_tokens=True) == "Hello world!"

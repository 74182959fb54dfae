"""Token ids to text as they are generated, with OpenAI's `stop` strings.

A token can complete a multi-byte character or change how the previous one
renders, so new ids are decoded with a few ids before them for context, and
the text they add is what that window decodes to past its context (decoding
all ids at every token was quadratic: 5.9 s of the event loop for one
8,000-token answer). A delta is released only when it is final: not ending in
an incomplete character, and not possibly the start of a stop string. A stop
string ends the output before it, as in OpenAI's API; one lying wholly in
the text of the first `min_tokens` ids does not count (as in vLLM).
"""
from __future__ import annotations

CONTEXT_IDS = 6  # ids decoded before the new ones, so that they render as within the whole text


class TextStream:
    """Incremental detokenizer of one request's output."""

    def __init__(self, tokenizer, stop: list[str] | None = None, min_tokens: int = 0) -> None:
        self.tokenizer, self.min_tokens = tokenizer, min_tokens
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []  # every id fed (the usage counts them)
        self.text = ""  # released so far
        self.stopped = False
        self._floor = 0  # length of the text of the first min_tokens ids: no stop string ends in it
        # special tokens decode to nothing here (skip_special_tokens): left out of the ids decoded, so a run
        # of them (EOS under ignore_eos) costs nothing and is never a window's only context
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._text_ids: list[int] = []
        self._done, self._done_ids = "", 0  # the text of _text_ids[:_done_ids], whole characters

    def feed(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; returns the text released by them ('' if none yet).
        `final`: the request ended, release everything left."""
        if self.stopped:
            return ""
        self.ids += new_ids
        self._text_ids += [t for t in new_ids if t not in self._special]
        full = self._decoded()
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        if final:
            return self._release(full)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            full = full.rstrip("\ufffd")
        return self._release(full[: max(len(self.text), len(full) - self._hold)])

    def _decoded(self) -> str:
        """The text of every id so far, decoding only the ids since the last whole character and a few before."""
        ids, start = self._text_ids, max(0, self._done_ids - CONTEXT_IDS)
        if len(ids) == self._done_ids:
            return self._done
        decode = self.tokenizer.decode
        head = decode(ids[start:self._done_ids], skip_special_tokens=True)
        tail = decode(ids[start:], skip_special_tokens=True)
        # a context that decodes to nothing is none: a Metaspace decoder (Llama, Mistral) drops the space of
        # a window's first word, as at the start of a text
        if (head or start == 0) and tail.startswith(head) and not head.endswith("\ufffd"):
            full = self._done + tail[len(head):]
        else:  # the new ids changed how the context renders: once, the whole text
            full = decode(ids, skip_special_tokens=True)
        if not full.endswith("\ufffd"):
            self._done, self._done_ids = full, len(ids)
        return full

    def _stop_at(self, full: str) -> int | None:
        if len(self.ids) <= self.min_tokens:
            self._floor = len(full)
            return None
        start = max(0, len(self.text) - self._hold)
        found = [i for s in self.stop if (i := full.find(s, max(start, self._floor - len(s) + 1))) >= 0]
        return min(found) if found else None

    def _release(self, upto: str) -> str:
        if not upto.startswith(self.text):  # the tokenizer re-rendered released text: release only what follows
            upto = self.text + upto[len(self.text):]
        delta, self.text = upto[len(self.text):], upto
        return delta

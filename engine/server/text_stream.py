"""Token ids to text as they are generated, with OpenAI's `stop` strings.

Text is decoded from all the output ids so far (a token can complete a
multi-byte character or change how the previous one renders), and a delta is
released only when it is final: not ending in an incomplete character, and
not possibly the start of a stop string. A stop string ends the output before
it, as in OpenAI's API.
"""
from __future__ import annotations


class TextStream:
    """Incremental detokenizer of one request's output."""

    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def feed(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; returns the text released by them ('' if none yet).
        `final`: the request ended, release everything left."""
        if self.stopped:
            return ""
        self.ids += new_ids
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        if final:
            return self._release(full)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            full = full.rstrip("\ufffd")
        return self._release(full[: max(len(self.text), len(full) - self._hold)])

    def _stop_at(self, full: str) -> int | None:
        start = max(0, len(self.text) - self._hold)
        found = [i for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(found) if found else None

    def _release(self, upto: str) -> str:
        if not upto.startswith(self.text):  # the tokenizer re-rendered released text: release only what follows
            upto = self.text + upto[len(self.text):]
        delta, self.text = upto[len(self.text):], upto
        return delta

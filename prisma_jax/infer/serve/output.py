"""One request's output as it grows: tokens → text (incremental, stop strings), logprobs and the uncertainty trace.

`Output.add(event)` takes the engine's `Tokens` for this request and returns a `Piece`: the tokens it accepted
(all of them, or those up to the one that completed a stop string), the text that may be shown now, and the
finish reason once there is one. End tokens and other special tokens are not shown; what may still turn into
a stop string, or ends in an incomplete UTF-8 sequence, is held back until it is decided.

Detokenization is incremental, as vLLM does it: each token's text is the difference between the decodings of
a short window of ids with and without it (the window starts a few tokens back, so that a tokenizer's
context-dependent spaces come out right), and stop strings are searched in the last characters only. A token
costs O(window + longest stop string), not O(tokens so far), so a long stream never slows the event loop.

Every token the model generated stays in the per-token arrays — the end token included — so that `codes`
and `entropies` line up with `PrismaVL.generate`'s `tokens` and `codes` (docs/introspection-contract.md §5).
"""
from __future__ import annotations

import dataclasses

from prisma_jax.infer.serve.engine import Tokens


@dataclasses.dataclass
class Piece:
    ids: list[int]
    codes: list[int]
    entropies: list[float]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    text: str
    finish: str | None


class Output:
    def __init__(self, decode, stop: list[str]):
        self.decode = decode                         # ids → text (special tokens skipped)
        self.stop = list(stop)
        self.longest = max((len(x) for x in self.stop), default=0)
        self.hold = max(self.longest - 1, 0)
        self.ids: list[int] = []
        self.codes: list[int] = []
        self.entropies: list[float] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.text = ""                               # the whole text so far (stop string removed)
        self.shown = 0                               # characters of `text` already handed out
        self.finish: str | None = None
        self._prefix = self._read = 0                # ids[prefix:read] decode to the text before the next token

    def _next_text(self, ids: list[int], end: int) -> str:
        """The text `ids[end - 1]` adds; "" while the window ends in an incomplete UTF-8 sequence."""
        before = self.decode(ids[self._prefix:self._read])
        now = self.decode(ids[self._prefix:end])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, end
            return now[len(before):]
        return ""

    def add(self, ev: Tokens) -> Piece:
        n, finish = len(ev.ids), ev.finish
        ids, text = self.ids + list(ev.ids), self.text
        for j in range(len(ev.ids)):
            before = len(text)
            text += self._next_text(ids, len(self.ids) + j + 1)
            if self.stop and len(text) > before:     # a stop string this token's text completes
                start = max(0, before - self.longest + 1)
                cut = min((i for i in (text.find(x, start) for x in self.stop) if i >= 0), default=-1)
                if cut >= 0:
                    n, finish, text = j + 1, "stop", text[:cut]
                    break
        take = slice(0, n)
        piece = Piece(ev.ids[take], ev.codes[take], ev.entropies[take], ev.logprobs[take], ev.top[take] if ev.top else [],
                      "", finish)
        self.ids += piece.ids
        self.codes += piece.codes
        self.entropies += piece.entropies
        self.logprobs += piece.logprobs
        self.top += piece.top
        self.text = text
        self.finish = finish
        end = len(self.text)
        if finish is None:
            end -= self.hold
        if end > self.shown:
            piece.text = self.text[self.shown:end]
            self.shown = end
        return piece

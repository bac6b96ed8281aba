"""One request's output as it grows: tokens → text (incremental, stop strings), logprobs and the uncertainty trace.

`Output.add(event)` takes the engine's `Tokens` for this request and returns a `Piece`: the tokens it accepted
(all of them, or those up to the one that completed a stop string), the text that may be shown now, and the
finish reason once there is one. Text is decoded from all tokens so far (end tokens and other special tokens
are not shown); what may still turn into a stop string, or ends in an incomplete UTF-8 sequence, is held back
until it is decided.

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
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.codes: list[int] = []
        self.entropies: list[float] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.text = ""                               # the whole text so far (stop string removed)
        self.shown = 0                               # characters of `text` already handed out
        self.finish: str | None = None

    def add(self, ev: Tokens) -> Piece:
        n, finish, text = len(ev.ids), ev.finish, None
        if self.stop:
            for j in range(len(ev.ids)):             # the first token whose text completes a stop string
                full = self.decode(self.ids + ev.ids[:j + 1])
                cut = min((i for i in (full.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0),
                          default=-1)
                if cut >= 0:
                    n, finish, text = j + 1, "stop", full[:cut]
                    break
        take = slice(0, n)
        piece = Piece(ev.ids[take], ev.codes[take], ev.entropies[take], ev.logprobs[take], ev.top[take] if ev.top else [],
                      "", finish)
        self.ids += piece.ids
        self.codes += piece.codes
        self.entropies += piece.entropies
        self.logprobs += piece.logprobs
        self.top += piece.top
        self.text = self.decode(self.ids) if text is None else text
        self.finish = finish
        end = len(self.text)
        if finish is None:
            end -= self.hold
            while end > self.shown and self.text[end - 1] == "\ufffd":
                end -= 1
        if end > self.shown:
            piece.text = self.text[self.shown:end]
            self.shown = end
        return piece

"""Stop sequences over streamed text: pass text on as it comes, hold back only what may begin a stop sequence."""
from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""  # text not passed on yet: the tail that may begin a stop sequence
        self.matched: str | None = None  # the stop sequence met (the first in the text; the first listed on a tie)

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to pass on, whether a stop sequence was met: the text ends before it, and nothing follows)."""
        self.pending += piece
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        """The text held back, at the end of the generation."""
        out, self.pending = self.pending, ""
        return out

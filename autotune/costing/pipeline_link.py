"""Past one Mac, predicted: the link between two pipeline stages and the prefill of stages whose chunks overlap.

A prompt's prefill runs in chunks. With the model's layers split across Macs (one stage per Mac, in layer order),
stage s takes chunk c once stage s-1 has finished it and its activations crossed the link (`chunk x hidden` values
per boundary per chunk), and once stage s itself has finished chunk c-1. So the chunks of one prompt overlap across
stages: while Mac 2 runs chunk 1's last layers, Mac 1 runs chunk 2's first ones.

    finish[s][c] = max(finish[s-1][c] + link[c], finish[s][c-1]) + stage[s][c]

The link is priced at the profile's `link` figure (`LinkFigure`: bytes over its rate plus a fixed cost per
transfer). A transfer occupies the link, not either Mac's units: the sender goes on to its next chunk.

Tensor parallelism (every Mac a slice of every layer) pays instead an `all_sum` of the chunk's hidden states after
each sliced matmul pair, on the critical path: no rank goes on before the sum (`all_sum_ms`).
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import NpumoeError

GB = 1e9


@dataclass(frozen=True)
class LinkFigure:
    """A link between two Macs: its data rate one way (GB/s), a fixed cost per transfer (ms) and how the figure is
    known (`label`: "published" or "measured")."""
    name: str
    gb_per_s: float
    latency_ms: float = 0.0
    label: str = "published"
    source: str = ""

    @classmethod
    def from_json(cls, obj: dict) -> "LinkFigure":
        return cls(str(obj["name"]), float(obj["gb_per_s"]), float(obj.get("latency_ms", 0.0)),
                   str(obj.get("label", "published")), str(obj.get("source", "")))

    def to_json(self) -> dict:
        return {"name": self.name, "gb_per_s": self.gb_per_s, "latency_ms": self.latency_ms, "label": self.label,
                "source": self.source}

    def transfer_ms(self, nbytes: float) -> float:
        """One transfer of `nbytes` over the link."""
        return self.latency_ms + nbytes / (self.gb_per_s * GB) * 1e3


def profile_link(extra: dict, override_gb_per_s: float | None = None) -> LinkFigure:
    """The profile's link figure (its `link` entry); `override_gb_per_s` replaces its rate (labelled as given)."""
    if override_gb_per_s is not None:
        latency = float(extra.get("link", {}).get("latency_ms", 0.0))
        return LinkFigure(f"{override_gb_per_s:g} GB/s (given)", override_gb_per_s, latency, "given", "--link-gb-s")
    if "link" not in extra:
        raise NpumoeError("this profile has no link figure between Macs (a `link` entry); use a profile that has one "
                          "(apple-m2-ultra-published) or give --link-gb-s")
    return LinkFigure.from_json(extra["link"])


def activation_bytes(rows: int, hidden: int, dtype_bytes: int = 2) -> int:
    """What crosses one stage boundary for one chunk: the hidden states of its rows."""
    return rows * hidden * dtype_bytes


def link_ms(link: LinkFigure, rows: int, hidden: int, dtype_bytes: int = 2) -> float:
    """One chunk's activations across one stage boundary."""
    return link.transfer_ms(activation_bytes(rows, hidden, dtype_bytes))


def all_sum_ms(link: LinkFigure, ranks: int, rows: int, hidden: int, dtype_bytes: int = 2) -> float:
    """One `all_sum` of `rows x hidden` over a ring of `ranks` Macs (what tensor parallelism pays after a sliced
    matmul): a ring all-reduce sends 2(N-1)/N of the bytes each way, one transfer's fixed cost counted once."""
    return link.transfer_ms(2 * (ranks - 1) / ranks * activation_bytes(rows, hidden, dtype_bytes))


def pipeline_ms(stage_chunk_ms: list[list[float]], link_chunk_ms: list[float]) -> float:
    """The prefill's latency with the prompt's chunks overlapping across stages: `stage_chunk_ms[s][c]`, stage s's
    time on chunk c; `link_chunk_ms[c]`, chunk c's activations across one boundary (each boundary alike)."""
    finish = [0.0] * len(link_chunk_ms)  # the previous stage's finish time per chunk
    for s, chunks in enumerate(stage_chunk_ms):
        done = 0.0  # this stage's finish of the previous chunk
        for c, ms in enumerate(chunks):
            arrive = finish[c] + (link_chunk_ms[c] if s else 0.0)
            done = max(arrive, done) + ms
            finish[c] = done
    return finish[-1]


def sequential_ms(stage_chunk_ms: list[list[float]], link_chunk_ms: list[float]) -> float:
    """The same prefill with no overlap: each chunk crosses every stage before the next chunk starts."""
    stages = len(stage_chunk_ms)
    return sum(sum(chunks) for chunks in stage_chunk_ms) + (stages - 1) * sum(link_chunk_ms)

"""The calibrate stage: a model's routing recorded on a text (`record_traces`), saved as traces, with the figures
`autotune calibrate` reports (expert shares, the process's peak memory beside the stage's prediction)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from autotune.calibration.mlx_engine import choose_engine, peak_memory_gb, record_mlx_traces
from autotune.calibration.texts import DEFAULT_CALIB_TEXT
from autotune.calibration.traces import Traces, check_prompts, default_traces_path, record_traces, save_traces
from autotune.calibration.workload import encode_text
from autotune.costing.cpu_storage import load_options
from autotune.costing.memory import ModelSize, beside_measured, model_size, stage_memory
from runtime.errors import NpumoeError
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.model_loader import load_model
from runtime.loading.model_record import ModelRecord, check_context
from runtime.resources import peak_rss_bytes

CHUNK_TOKENS, PROMPT_TOKENS, MAX_TOKENS = 256, 1024, 32768


@dataclass
class Calibration:
    path: str  # the traces file written
    traces: Traces
    summary: dict  # what `calibrate --json` prints


def calibrate(record: ModelRecord, text: str = DEFAULT_CALIB_TEXT, *, chunk: int = CHUNK_TOKENS,
              prompt_tokens: int = PROMPT_TOKENS, max_tokens: int = MAX_TOKENS, out: str | os.PathLike | None = None,
              progress: bool = True, cpu_weights: str | None = None, engine: str = "torch") -> Calibration:
    """Record the routing of the model `record` describes (`runtime.loading.model_record.resolve_model`, its dtype
    holds) on `text` (a file or a built-in text name) and save the traces to `out` (default
    `traces/<model>.npz`). `engine`: torch (our loader's model), mlx (mlx-lm's own model of the folder, on the GPU
    on a Mac) or auto (`choose_engine`)."""
    if chunk > prompt_tokens:
        raise NpumoeError(f"--chunk {chunk} is longer than --prompt-tokens {prompt_tokens}: a prompt is prefilled in "
                          "chunks of at most its length; give --chunk <= --prompt-tokens")
    check_context(record.name, record.context, prompt_tokens)
    path = str(out or default_traces_path(record.name))
    engine = choose_engine(engine, record.name)
    t0 = time.perf_counter()
    if engine == "mlx":
        if cpu_weights:
            raise NpumoeError("--cpu-weights is how the torch engine holds the experts; --engine mlx runs mlx-lm's "
                              "model on the folder's own weights: leave --cpu-weights out")
        traces, tokens = record_mlx_traces(record.name, text, chunk, prompt_tokens, max_tokens, record.dtype,
                                           progress)
        size = model_size(record)
    else:
        loaded, tokenizer = load_model(record.name, record.compute_dtype, **load_options(cpu_weights)) \
            if cpu_weights else record.loaded()
        ids = encode_text(tokenizer, text, max_tokens)
        check_token_ids(loaded, ids)
        check_prompts(len(ids), prompt_tokens, text)
        traces, tokens, size = record_traces(loaded, ids, chunk, prompt_tokens, text, progress=progress,
                                             engine="torch"), len(ids), ModelSize.of(loaded)
    seconds = time.perf_counter() - t0
    save_traces(traces, path)
    predicted = stage_memory(size, "calibrate", chunk, prompt_tokens, tokens=tokens)
    memory = beside_measured(predicted, peak_rss_bytes())
    if engine == "mlx":
        memory["mlx_peak_gb"] = peak_memory_gb()
    return Calibration(path=path, traces=traces, summary={
        **_calibration_summary(traces, path), "engine": engine, "device": traces.header.get("device", "cpu"),
        "seconds": round(seconds, 3), "memory": memory})


def _calibration_summary(traces: Traces, path: str) -> dict:
    layers = traces.header["model"]["moe_layers"]
    shares = {str(l): (traces.counts(l, "calib").sum(0) / max(1, traces.counts(l, "calib").sum())).round(4).tolist()
              for l in layers}
    return {"traces": path, "tokens": traces.header["tokens"], "chunks": traces.n_chunks,
            "heldout_chunks": int(traces.heldout_chunks.sum()),
            "max_expert_share_x_uniform": {l: float(np.max(s) * len(s)) for l, s in shares.items()},
            "layer0_shares": shares[str(layers[0])]}

"""Text generation under a plan: the runtime's application API, after mlx-lm's `load` / `generate` /
`stream_generate`. Prefill feeds the prompt in the plan's chunks (as `autotune run` does), so static groups see the
chunk sizes they were tuned for; decode feeds one token a step, which the executor's decode policy runs exactly.
Everything reported is measured here: time to first token (prefill + first sample), prefill and generation tokens per
second, the process's peak RSS, and the executor's statistics (prefill and decode apart)."""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch

from runtime.detokenizer import StreamingDetokenizer
from runtime.engines import resolve_engine, torch_only
from runtime.errors import NpumoeError
from runtime.executor import PlanExecutor
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.model_loader import load_model
from runtime.loading.model_record import read_model_spec
from runtime.logprobs import TokenLogprob, token_logprobs
from runtime.packages import bind_package, torch_target
from runtime.plan import Plan, check_plan_matches, load_plan
from runtime.prefill import chunk_spans, exact_tail, prefill_chunks
from runtime.resources import peak_rss_mb
from runtime.stats import Executed, RunStats

log = logging.getLogger("npumoe")

DEFAULT_MAX_TOKENS = 100


@dataclass
class Loaded:
    """A model ready to generate. `.model` has the plan installed, so `.model.generate()` runs under it too."""
    model: torch.nn.Module
    tokenizer: object
    plan: Plan | None = None
    executor: PlanExecutor | None = None  # on the MLX spine: its `MlxSpine` (the same run statistics and phases)
    engine: str = "torch"  # the spine: "torch" (`.model` a transformers model) or "mlx" (a `SpineModel`)
    cluster: object | None = None  # across Macs: this rank's `runtime.mlx.cluster.Cluster` (its layers, its link)
    _no_stats: RunStats = field(default_factory=RunStats, repr=False)

    @property
    def stats(self) -> RunStats:
        """What the executor did (prefill and decode apart); empty without a plan."""
        return self.executor.stats if self.executor else self._no_stats

    def reset(self) -> None:
        """Count afresh: run statistics and the drift monitor."""
        if self.executor:
            self.executor.reset()

    @contextmanager
    def unmodified(self) -> Iterator[None]:
        """The model without the plan for the duration (a reference run)."""
        with self.executor.applied(False) if self.executor else nullcontext():
            yield

    def pin_phase(self, phase: str) -> None:
        """Count what follows as `phase` ("prefill" or "decode") until `unpin_phase`."""
        if self.executor:
            self.executor.set_phase(phase, pin=True)

    def unpin_phase(self) -> None:
        """Each forward classifies itself again (as under `.model.generate()`)."""
        if self.executor:
            self.executor.set_phase(self.executor.phase, pin=False)


def load(model: str, plan: str | os.PathLike | Plan | None = None, package: str | None = None,
         dtype: str = "auto", cpu_weights: str | None = None, group_size: int = 64, engine: str = "torch",
         cluster: object | None = None) -> Loaded:
    """Load `model` (a built-in name, a local transformers directory or an MLX folder) and install `plan` on it, if
    given. `package`: the Core ML package `autotune build` made for the plan's `ane` groups. `cpu_weights`: int8 or
    int4 (groups of `group_size`) quantizes the experts the CPU holds at load (`runtime.cpu.cpu_weights`); None: as
    the plan's optional `cpu_weights` says (its kernels from its `kernel_rows`), else as loaded. `engine`: the spine
    (`runtime.engines`; torch by default). `cluster`: under mlx.launch, this rank's part (`cluster.ClusterSpec`)."""
    if cluster is not None:  # its stage alone, on the MLX spine under its stage's plan
        from runtime.mlx.cluster import load_rank
        return Loaded(**load_rank(cluster, model, dtype, package))
    p = None if plan is None else plan if isinstance(plan, Plan) else load_plan(plan)
    if p is None and package:
        raise NpumoeError("a package runs a plan's ane groups: give the plan too")
    if resolve_engine(engine, p, torch_only(p, cpu_weights)) == "mlx":
        return _load_mlx(model, p, "" if isinstance(plan, Plan) else str(plan or ""), dtype, package)
    if cpu_weights is not None and p is not None and p.cpu_weights is not None:
        planned = (p.cpu_weights.kind, (p.cpu_weights.group_size or 64) if p.cpu_weights.kind == "int4" else None)
        if planned != (cpu_weights, group_size if cpu_weights == "int4" else None):
            said = f"{planned[0]}:{planned[1]}" if planned[1] else planned[0]
            raise NpumoeError(f"--cpu-weights {cpu_weights}{f':{group_size}' if cpu_weights == 'int4' else ''}: the "
                              f"plan {'' if isinstance(plan, Plan) else plan} holds its CPU experts as {said}; leave "
                              "--cpu-weights out, or search a plan with it")
    if cpu_weights is None and p is not None and p.cpu_weights is not None:
        cpu_weights, group_size = p.cpu_weights.kind, p.cpu_weights.group_size or group_size
    kernel_rows = p.cpu_weights.kernel_rows if p is not None and p.cpu_weights is not None else None
    path = "" if isinstance(plan, Plan) else str(plan)
    if p is not None:  # a plan of another model refused from the record, before the weights load (and their notes)
        check_plan_matches(p, read_model_spec(model), path)
    m, tokenizer = load_model(model, dtype, cpu_weights or "bf16", group_size, kernel_rows)
    if p is None:
        return Loaded(m, tokenizer)
    backends = bind_package(package, p, torch_target(m), path)
    executor = PlanExecutor(m, p, backends, plan_path=path, options={"package": package}).install()
    return Loaded(m, tokenizer, p, executor)


def _load_mlx(model: str, plan: Plan | None, path: str, dtype: str, package: str | None) -> Loaded:
    """`load` on the MLX spine (`runtime.mlx.spine`): mlx-lm's own model of the folder, the plan installed on it
    (with `package`'s backend, bound as on the torch spine), prefilling with the plan's `in_flight` chunks in flight."""
    from runtime.mlx.spine import MlxSpine
    from runtime.mlx.spine_generation import SpineModel
    from runtime.mlx.spine_loading import load_mlx_model

    m, tokenizer, folder = load_mlx_model(model, dtype)
    spine = MlxSpine(m, plan, folder, plan_path=path, package=package).install() if plan is not None else None
    return Loaded(SpineModel(m, folder, spine, (plan and plan.in_flight) or 1), tokenizer, plan, spine, engine="mlx")


def chat_prompt(tokenizer: object, prompt: str | list[dict]) -> str | None:
    """The prompt (one user turn, or a list of {"role", "content"} messages) in the tokenizer's chat template, ready
    for the assistant's turn; None when it has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_ids(loaded: Loaded, prompt: str | Sequence[int], chat: bool = False) -> torch.Tensor:
    """The prompt's token ids as generation feeds them (chat template applied when asked)."""
    if not isinstance(prompt, str):  # token ids already
        ids = list(prompt)
        if chat:
            raise NpumoeError("chat needs the prompt as text, not token ids")
    else:
        text = chat_prompt(loaded.tokenizer, prompt) if chat else None
        if chat and text is None:
            log.warning("the tokenizer has no chat template; the prompt is used as it is")
        ids = loaded.tokenizer.encode(prompt if text is None else text, add_special_tokens=False)
    if len(ids) == 0:
        raise NpumoeError("the prompt holds no tokens")
    tensor = torch.tensor(ids, dtype=torch.long)
    if isinstance(prompt, str):  # ids past the embedding from the tokenizer: its files are another model's
        check_token_ids(loaded.model, tensor)
    else:  # the caller's ids: a bad one is the prompt's fault
        rows = loaded.model.get_input_embeddings().num_embeddings
        bad = tensor[(tensor < 0) | (tensor >= rows)]
        if bad.numel():
            raise NpumoeError(f"the prompt's token id {int(bad[0])} is not in the model's vocabulary (ids 0 to "
                              f"{rows - 1})")
    return tensor


def _eos_ids(loaded: Loaded) -> set[int]:
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = loaded.model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def is_greedy(temp: float) -> bool:
    """A temperature of 0, or so small that float32 holds it as 0: the most likely token each step."""
    return temp < torch.finfo(torch.float32).tiny


def _sample(logits: torch.Tensor, temp: float, gen: torch.Generator, top_p: float = 1.0) -> int:
    if is_greedy(temp):
        return int(logits.argmax())
    z = logits.float()
    probs = torch.softmax((z - z.max()) / temp, dim=-1)  # shifted first: a tiny temperature cannot overflow
    if top_p < 1.0:  # nucleus: the most likely tokens whose mass reaches top_p (always at least the first)
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p
        outside[0] = False  # a top_p below float32's smallest still keeps the likeliest token
        sorted_probs[outside] = 0.0
        return int(order[torch.multinomial(sorted_probs, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def context_positions(model: torch.nn.Module) -> int | None:
    """How many positions the model's context holds (config `max_position_embeddings`); None where unstated."""
    n = getattr(model.config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


class ContextLimitError(NpumoeError):
    """A request past the model's context; `param` names what is too long: "max_tokens" or "prompt"."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def max_new_tokens(model: torch.nn.Module, prompt_tokens: int, max_tokens: int, least: int = 1) -> int:
    """The one rule for new tokens against the model's context (`generate`, `stream_generate`, the server):
    refused up front when `max_tokens` alone is past the context (a request no prompt could fit, such as 10**12)
    or the prompt leaves no room for one new token; otherwise `max_tokens` bounded so that prompt + new <=
    positions, generation past the bound stopping with finish_reason "length". `prompt_tokens` 0: only the
    checks `max_tokens` alone can fail (what a server asks before it has encoded the prompt). `least` 0: no new
    token is asked for (scoring the prompt, as an echo with `max_tokens` 0 does), so the prompt may fill the
    context."""
    if max_tokens < least:
        raise ContextLimitError(f"max_tokens must be at least {least}, got {max_tokens}", "max_tokens")
    positions = context_positions(model)
    if positions is None:
        return max_tokens
    if max_tokens > positions:
        raise ContextLimitError(f"max_tokens {max_tokens} is past the model's context of {positions} positions: "
                                f"ask for at most {max(0, positions - prompt_tokens)} new tokens after this "
                                "prompt", "max_tokens")
    if prompt_tokens > positions - min(max_tokens, 1):
        raise ContextLimitError(f"the prompt holds {prompt_tokens} tokens; the model's context holds {positions} "
                                "positions, so no token fits after it", "prompt")
    return min(max_tokens, positions - prompt_tokens)


MEASURED = ("prompt_tokens", "generated_tokens", "ttft_ms", "prefill_tok_s", "generation_tok_s", "decode_step_ms",
            "peak_rss_mb", "dropped", "spilled", "prefill_static_calls", "decode_static_calls", "finish_reason",
            "chunk_tokens")  # GenerationResult's JSON, in this order


@dataclass(frozen=True)
class Comparison:
    """`generate(compare=True)`: the unmodified model on the same prompt and chunks, and the ratios (>1: the plan
    is faster)."""
    reference_ttft_ms: float
    reference_prefill_tok_s: float
    reference_generation_tok_s: float | None
    prefill_speedup: float
    generation_speedup: float | None
    same_tokens: bool


@dataclass
class GenerationResult:
    """What one generation measured (`runtime.generate`); `to_json()` is what `autotune generate --json` prints.
    `model` to `traces` are what the command adds (the run's name, its memory against the plan's prediction...):
    None here is left out of the JSON, except `plan` once `model` is set."""
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_tok_s: float
    generation_tok_s: float | None
    decode_step_ms: float | None
    peak_rss_mb: float
    dropped: int
    spilled: int
    prefill_static_calls: int
    decode_static_calls: int
    finish_reason: str
    chunk_tokens: int
    token_ids: list[int]
    text: str
    comparison: Comparison | None = None
    model: str | None = None
    plan: str | None = None
    drift: dict | None = None
    memory: dict | None = None
    plan_predicted: dict | None = None
    traces: dict | None = None
    executed: dict | None = None  # per part, the lanes that ran it (`runtime.stats.Executed`); with a plan
    engine: str | None = None  # the spine that generated: "torch" or "mlx"

    def to_json(self) -> dict:
        head = {"model": self.model, "plan": self.plan} if self.model is not None else {}
        own = {k: getattr(self, k) for k in MEASURED}
        comparison = asdict(self.comparison) if self.comparison else {}
        tail = {k: getattr(self, k) for k in ("drift", "memory", "plan_predicted", "traces", "executed", "engine")
                if getattr(self, k) is not None}
        return {**head, **own, "token_ids": list(self.token_ids), "text": self.text, **comparison, **tail}



class Generation:
    """One generation: produces tokens, then text pieces, and keeps the measured timings.

    `prefix`: a KV cache already holding the prompt's first tokens (a multiple of `chunk_tokens`, fewer than the
    prompt; or more, ending inside the prompt's last chunk where that chunk runs exactly: `prefill.exact_tail`),
    so prefill starts after them and meets the same chunk boundaries as without it. `keep_at`: a chunk boundary,
    or the prompt's end (tokens from the prompt's start), whose KV tensors `kept` holds once prefill has passed
    it, per layer (keys, values), for the caller to keep. `logprobs`: keep each new token's log-probability and
    its `logprobs` most likely alternatives (`token_logprobs`; an end-of-text token that stops it included); `echo`:
    the prompt's too (`prompt_logprobs`, from the logits of every prefill position; no reused prefix then), and
    `max_tokens` 0 scores the prompt only. Stopping the iteration early is cancelling: nothing more runs."""

    def __init__(self, loaded: Loaded, ids: torch.Tensor, max_tokens: int, temp: float, seed: int,
                 chunk_tokens: int | None, top_p: float = 1.0, prefix: object | None = None,
                 keep_at: int | None = None, logprobs: int | None = None, echo: bool = False) -> None:
        self.loaded, self.ids, self.temp, self.top_p = loaded, ids, temp, top_p
        self.max_tokens = max_new_tokens(loaded.model, ids.numel(), max_tokens, 0 if echo else 1)
        self.top, self.echo = logprobs, echo
        if echo and prefix is not None:
            raise NpumoeError("echo scores every prompt token: a reused prefix has no logits to score")
        self.gen = torch.Generator().manual_seed(seed)
        self.chunk = chunk_tokens or ids.numel()
        # the plan's uneven chunking from the prompt's start only (after a reused prefix: chunks of chunk_tokens)
        self.chunk_rows = tuple(loaded.plan.chunk_rows or ()) if loaded.plan and prefix is None else ()
        self.prefix, self.keep_at = prefix, keep_at
        self.cached = cache_length(loaded, prefix)
        boundary = self.cached // self.chunk * self.chunk
        exact_below = loaded.plan.exact_below if loaded.plan else self.chunk + 1
        if self.cached >= ids.numel() or (self.cached > boundary
                                          and not exact_tail(ids.numel(), boundary, self.chunk, exact_below)):
            raise NpumoeError(f"a reused prefix must be a whole number of {self.chunk}-token chunks shorter than "
                              "the prompt, or end in the prompt's last chunk where that chunk runs exactly, got "
                              f"{self.cached} of {ids.numel()} tokens")
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.prompt_logprobs: list[TokenLogprob] = []
        self._last_row: torch.Tensor | None = None  # with echo: the logits of the last position scored so far
        self.token_logprobs: list[TokenLogprob] = []
        self.tokens: list[int] = []
        self.eos = _eos_ids(loaded)
        self.pending: int | None = None  # the token sampled and not yet taken (`accept`)
        self.cache: object | None = None  # the KV cache once prefill is done
        self.ahead: object | None = None  # the MLX spine's next decode step, scheduled before this one's token is read
        self.ttft_s = self.decode_s = self.t1 = 0.0
        self.step_s: list[float] = []  # each decode step's forward + sample, without the caller's time between
        self.finish_reason = "length"

    def prefill_steps(self) -> Iterator[int]:
        """`_torch_prefill_steps`, or the MLX spine's own (`SpineModel.prefill_steps`)."""
        if self.loaded.engine == "mlx":
            return self.loaded.model.prefill_steps(self)
        return self._torch_prefill_steps()

    def _torch_prefill_steps(self) -> Iterator[int]:
        """Prefill in the plan's chunks, one chunk per step (with `echo`, each prompt token's log-probability from
        the position before it): yields the prompt tokens done after each chunk but the last. A caller may run
        other forwards between steps (each chunk pins the prefill phase itself). Once it ends, the first new token
        is pending (`accept`), `cache` holds the prompt and `ttft_s` is measured from the first chunk."""
        n, done = self.ids.numel(), self.cached
        chunks = prefill_chunks(self.loaded.model, self.ids[self.cached:], self.chunk,
                                last_logits_only=not self.echo, cache=self.prefix, rows=self.chunk_rows)
        spans = iter(chunk_spans(n - self.cached, self.chunk, self.chunk_rows))
        t0 = time.perf_counter()
        while done < n:
            self.loaded.pin_phase("prefill")
            with torch.inference_mode():
                out = next(chunks)
            start, done = done, self.cached + next(spans)[1]
            if done == self.keep_at:  # dynamic caches grow by concatenation: these tensors stay as they are
                self.kept = [(layer.keys, layer.values) for layer in out.cache.layers]
            if self.echo:
                self.score(start, done, out.logits[0])
            if done < n:
                yield done
        if self.max_tokens:
            with torch.inference_mode():
                self.sample(out.logits[0, -1])
        self.cache = out.cache
        self.t1 = time.perf_counter()
        self.ttft_s = self.t1 - t0

    def score(self, start: int, done: int, logits: torch.Tensor) -> None:
        """With `echo`: the log-probabilities of the prompt's tokens start..done, from the logits of every position
        of the forward that ran them (`logits` [done - start, vocab]), each token predicted by the position before
        it (the prompt's first token by none)."""
        first = self._last_row is None
        rows = logits if first else torch.cat([self._last_row, logits])
        if first:
            self.prompt_logprobs.append(TokenLogprob(int(self.ids[0]), None, None))
        self.prompt_logprobs += token_logprobs(rows[:-1], self.ids[start + first:done], self.top or 0)
        self._last_row = logits[-1:]

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temp)

    def sample(self, logits: torch.Tensor | None, token: int | None = None) -> None:
        """The next token from this position's logits (or `token`, where the spine took the greedy one itself),
        pending; its log-probability kept when asked (`logits` then needed)."""
        self.pending = _sample(logits, self.temp, self.gen, self.top_p) if token is None else token
        if self.top is not None:
            self.token_logprobs += token_logprobs(logits[None], torch.tensor([self.pending]), self.top)

    def accept(self) -> int | None:
        """The pending token, taken into the output; None where the generation ends instead (an end-of-text
        token, `finish_reason` "eos"; or nothing pending)."""
        tok, self.pending = self.pending, None
        if tok is None:
            return None
        if tok in self.eos:
            self.finish_reason = "eos"
            return None
        self.tokens.append(tok)
        self.decode_s = time.perf_counter() - self.t1
        return tok

    @property
    def full(self) -> bool:
        """Whether `max_tokens` are out: no decode step is needed."""
        return len(self.tokens) >= self.max_tokens

    def step(self) -> None:
        """One decode step on this generation's own cache (a batch runs its own: `serving.decode_batch`)."""
        if self.loaded.engine == "mlx":
            return self.loaded.model.step(self)
        t = time.perf_counter()
        self.loaded.pin_phase("decode")
        with torch.inference_mode():
            out = self.loaded.model(input_ids=torch.tensor([[self.tokens[-1]]]), cache=self.cache, use_cache=True,
                                    logits_to_keep=1)
            self.sample(out.logits[0, -1])
        self.cache = out.cache
        self.step_s.append(time.perf_counter() - t)

    def token_ids(self) -> Iterator[int]:
        try:
            for _ in self.prefill_steps():
                pass
            while (tok := self.accept()) is not None:
                yield tok
                if self.full:
                    return
                self.step()
        finally:
            self.loaded.unpin_phase()

    def pieces(self, every_token: bool = False) -> Iterator[str]:
        """Incremental detokenisation (linear in the output: `StreamingDetokenizer`): yield the new text after
        each token, a trailing incomplete character held back until the bytes that finish it arrive.
        `every_token`: yield "" for a token that adds no text yet (a server's client then sees every token
        arrive)."""
        detokenizer = StreamingDetokenizer(self.loaded.tokenizer)
        for tok in self.token_ids():
            piece = detokenizer.add(tok)
            if piece or every_token:
                yield piece
        if tail := detokenizer.finish():
            yield tail

    def result(self, text: str, comparison: Comparison | None = None) -> GenerationResult:
        stats = self.loaded.stats
        total = stats.total()
        n = len(self.tokens)
        return GenerationResult(
            prompt_tokens=int(self.ids.numel()), generated_tokens=n, ttft_ms=self.ttft_s * 1e3,
            prefill_tok_s=(self.ids.numel() - self.cached) / self.ttft_s,
            generation_tok_s=_tok_s(n, self.decode_s),
            decode_step_ms=statistics.median(self.step_s) * 1e3 if self.step_s else None,
            peak_rss_mb=peak_rss_mb(), dropped=total.dropped, spilled=total.spilled,
            prefill_static_calls=stats.static_calls("prefill"), decode_static_calls=stats.static_calls("decode"),
            finish_reason=self.finish_reason, chunk_tokens=self.chunk, token_ids=list(self.tokens), text=text,
            comparison=comparison, executed=executed_of(self.loaded), engine=self.loaded.engine)


@contextmanager
def batched_step(loaded: Loaded, rows: list[Generation]) -> Iterator[None]:
    """One decode step of every generation of `rows` in one forward (continuous batching, on either spine): the
    decode phase pinned, the executor told the step holds `len(rows)` sequences (each one-token row stays on the
    exact path) and back to one after, and the step's time kept for every row once it completed."""
    t = time.perf_counter()
    executor = loaded.executor
    loaded.pin_phase("decode")
    if executor is not None:
        executor.set_sequences(len(rows))
    try:
        yield
    finally:
        if executor is not None:
            executor.set_sequences(1)
    dt = time.perf_counter() - t
    for gen in rows:
        gen.step_s.append(dt)


def cache_length(loaded: Loaded, cache: object | None) -> int:
    """The tokens a KV cache of `loaded`'s spine holds (a transformers `DynamicCache`, or mlx-lm's per-layer caches
    on the MLX spine); 0 for none."""
    if cache is None:
        return 0
    return loaded.model.cache_length(cache) if loaded.engine == "mlx" else cache.get_seq_length()


def executed_of(loaded: Loaded) -> dict | None:
    """What ran each part under the plan since the last reset: on the MLX spine every part (calls; MLX's time where
    a timed pass measured it), on the torch spine the experts' lanes (each call timed); None without a plan."""
    if loaded.executor is None:
        return None
    if loaded.engine == "mlx":
        return loaded.executor.executed().to_json()
    out = Executed()
    out.add_experts(loaded.stats.total())
    return out.to_json()


def _tok_s(tokens: int, decode_s: float) -> float | None:
    """Generation speed: the tokens after the first over the time they took."""
    return (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None


def _start(loaded: Loaded, prompt: str | Sequence[int], max_tokens: int, temp: float, seed: int,
           chat: bool) -> Generation:
    ids = prompt_ids(loaded, prompt, chat)
    return Generation(loaded, ids, max_tokens, temp, seed, loaded.plan.chunk_tokens if loaded.plan else None)


def stream_generate(loaded: Loaded, prompt: str | Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS,
                    temp: float = 0.0, seed: int = 0, chat: bool = False) -> Iterator[str]:
    """Yield the generated text piece by piece as it comes (greedy when `temp` is 0). `prompt`: text or token
    ids."""
    run = _start(loaded, prompt, max_tokens, temp, seed, chat)
    loaded.reset()
    yield from run.pieces()


def generate(loaded: Loaded, prompt: str | Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS, temp: float = 0.0,
             seed: int = 0, chat: bool = False, compare: bool = False,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate from `prompt`; returns the measured figures and the text (`.to_json()`: see `autotune generate
    --json`).

    `on_text` receives each text piece as it comes. `compare` also runs the unmodified model on the same prompt
    (same prefill chunks) after an untimed warm-up of both, and reports its timings, the speed ratios and whether
    the tokens match."""
    run = _start(loaded, prompt, max_tokens, temp, seed, chat)
    if compare:
        _warm_up(loaded, run.ids, run.chunk)
    loaded.reset()
    pieces = []
    for piece in run.pieces():
        pieces.append(piece)
        if on_text is not None:
            on_text(piece)
    comparison = None
    if compare:
        with loaded.unmodified():
            ref = Generation(loaded, run.ids, max_tokens, temp, seed, run.chunk)
            for _ in ref.token_ids():
                pass
        ours, theirs = _tok_s(len(run.tokens), run.decode_s), _tok_s(len(ref.tokens), ref.decode_s)
        comparison = Comparison(
            reference_ttft_ms=ref.ttft_s * 1e3, reference_prefill_tok_s=run.ids.numel() / ref.ttft_s,
            reference_generation_tok_s=theirs, prefill_speedup=ref.ttft_s / run.ttft_s,
            generation_speedup=ours / theirs if ours is not None and theirs is not None else None,
            same_tokens=ref.tokens == run.tokens)
    return run.result("".join(pieces), comparison)


def _warm_up(loaded: Loaded, ids: torch.Tensor, chunk: int) -> None:
    """One short untimed generation each way, so neither measured run pays first-call costs."""
    for ctx in (loaded.unmodified, nullcontext):
        with ctx():
            for _ in Generation(loaded, ids, 2, 0.0, 0, chunk).token_ids():
                pass

"""GGUF files as llama.cpp users have them, checked against llama.cpp itself (issue 57).

    python scripts/bench_gguf.py --json [--quants Q8_0,Q4_K_M] [--tokens 4096] [--cache DIR] [--jobs 2]
    python scripts/bench_gguf.py --json --files F.gguf[,G.gguf] [--tokens N]   # our side alone, no llama.cpp

1. Builds llama.cpp from llama-cpp-python's source package (`vendor/llama.cpp`, cmake; libllama, which holds the
   forward and the quantizer llama-quantize calls) into the cache folder, once (minutes on two cores; its log:
   <cache>/build.log).
2. Converts tiny-moe to an F16 GGUF with llama.cpp's own convert_hf_to_gguf.py (given the config's top-level
   `rope_theta`, and `get_vocab_base_pre` answering "gpt-2": tiny-moe's pre-tokenizer is GPT-2's byte-level regex,
   which the converter does not recognise by its hash; patched at run time), then quantizes it with llama.cpp's
   `llama_model_quantize` (what llama-quantize runs), through llama-cpp-python's bindings.
3. Per quantization, each in its own process: our perplexity on `builtin:pydoc-heldout` (the first --tokens tokens,
   non-overlapping chunks of 512, each from a cold start) against llama.cpp's on the same token ids (its logits
   through llama-cpp-python's bindings, run from the source package), top-1 agreement of the two, the experts' bytes
   as we hold them against the file's, and our process's peak RSS.
4. `autotune search --model tiny-moe-Q4_K_M.gguf --profile apple-m2-ultra-published` (its gate), and
   `autotune generate --model F --plan P --prompt "def"` against llama.cpp's greedy tokens (32), per file.

With --files, steps 3 and 4 without llama.cpp on GGUF files given (tests/test_bench_scripts.py writes one with the
gguf package): our perplexity, bytes and memory, search and generate; no build, no reference figures.

Needs: cmake and a C++ compiler; pip (to fetch the source package); the `bench` extra (`pip install -e '.[bench]'`:
llama-cpp-python's diskcache and jinja2, the gguf package). Figures are measured on this host, side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from script_deps import require  # noqa: E402  (scripts/)

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama",)
# x86-64: AVX2-level kernels, not -march=native: on a Xeon with AMX, native builds take ggml's AMX int8 path for
# Q8_0/Q4_K, which dies with SIGILL where the kernel does not grant the tile state (measured here, in a container)
CPU_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON") if platform.machine().lower() in ("x86_64", "amd64") else ()
TEXT = "builtin:pydoc-heldout"
CHUNK = 512
GREEDY_TOKENS = 32
PROMPT = "def"
PROFILE = "apple-m2-ultra-published"


def log(msg: str) -> None:
    print(f"[bench_gguf] {msg}", file=sys.stderr, flush=True)


def default_cache() -> Path:
    base = os.environ.get("NPUMOE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                          os.path.expanduser("~/.cache"), "npumoe")
    return Path(base) / "llama_cpp"


def source_package(cache: Path) -> Path:
    """llama-cpp-python's source package, fetched with pip and unpacked into the cache (once)."""
    src = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    log(f"fetching llama-cpp-python {LLAMA_CPP_PYTHON}'s source package")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(cache),
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True, stdout=subprocess.DEVNULL)
    with tarfile.open(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
        tar.extractall(cache, filter="data")
    return src


def build_llama_cpp(cache: Path, jobs: int) -> Path:
    """llama.cpp's libraries, built once; returns the folder holding them."""
    llama = source_package(cache) / "vendor" / "llama.cpp"
    bin_dir = llama / "build" / "bin"
    stamp = llama / "build" / "npumoe-build.json"  # what the build was configured with: another is rebuilt
    if (bin_dir / "libllama.so").exists() and stamp.exists() and json.loads(stamp.read_text()) == list(CPU_FLAGS):
        return bin_dir
    build_log = cache / "build.log"
    log(f"building llama.cpp with {jobs} jobs (minutes; log: {build_log})")
    start = time.time()
    with open(build_log, "a") as out:
        subprocess.run(["nice", "-n", "10", "cmake", "-S", str(llama), "-B", str(llama / "build"),
                        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        "-DGGML_OPENMP=OFF", *CPU_FLAGS], check=True, stdout=out, stderr=out)
        subprocess.run(["nice", "-n", "10", "cmake", "--build", str(llama / "build"), f"-j{jobs}", "--target",
                        *TARGETS], check=True, stdout=out, stderr=out)
    stamp.write_text(json.dumps(list(CPU_FLAGS)))
    log(f"llama.cpp built in {time.time() - start:.0f} s")
    return bin_dir


CONVERT = """
import sys
sys.path.insert(0, {gguf_py!r}); sys.path.insert(0, {llama!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # GPT-2's byte-level regex (see the docstring)
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", "f16", "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def convert_f16(llama: Path, source: Path, out: Path) -> Path:
    """A transformers folder as an F16 GGUF by llama.cpp's own converter (its vendored gguf-py, in a process of its
    own), from a copy whose config.json has the top-level `rope_theta` it reads (the weights linked, not copied)."""
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / source.name
        src.mkdir()
        for f in source.iterdir():
            (src / f.name).symlink_to(f.resolve())
        (src / "config.json").unlink()
        config = json.loads((source / "config.json").read_text())
        config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if not config.get("architectures"):  # a shape twin names only its model_type; the converter needs both
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
        (src / "config.json").write_text(json.dumps(config, indent=1))
        code = CONVERT.format(gguf_py=str(llama / "gguf-py"), llama=str(llama), src=str(src), out=str(out))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        out.unlink(missing_ok=True)  # no half-written file left for the next run to take
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {proc.stderr.strip()[-1500:]}")
    return out


def quantize(bin_dir: Path, sdist: Path, f16: Path, quant: str, out: Path) -> Path:
    if not out.exists():
        try:
            worker("quantize", [str(bin_dir), str(sdist), str(f16), quant, str(out)])
        except RuntimeError:
            out.unlink(missing_ok=True)
            raise
    return out


def quantize_worker(lib: str, sdist: str, f16: str, quant: str, out: str) -> dict:
    """llama.cpp's quantizer (`llama_model_quantize`, as llama-quantize calls it with the type's defaults)."""
    import ctypes

    sys.path.insert(0, sdist)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = 1
    code = llama_cpp.llama_model_quantize(f16.encode(), out.encode(), ctypes.byref(params))
    if code:
        raise RuntimeError(f"llama_model_quantize to {quant} failed ({code})")
    return {"quant": quant, "file": out}


def worker(kind: str, args: list[str]) -> dict:
    """This script in another process (`--worker kind`): a clean peak RSS, and llama.cpp's libraries apart."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if kind in ("llama", "quantize"):
        env["LLAMA_CPP_LIB_PATH"] = args[0]
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, *args], env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise RuntimeError(f"{kind} worker failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ours_worker(file: str, tokens: int, out: str) -> dict:
    """Our reader's model of the file: perplexity and per-position argmax over the text's first `tokens` tokens."""
    import numpy as np
    import torch

    from autotune.calibration.texts import read_text
    from autotune.costing.memory import model_size
    from runtime.loading.model_loader import load_model, moe_layers
    from runtime.loading.model_record import resolve_model

    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model, tokenizer = load_model(file, "float32")
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    ids = tokenizer.encode(read_text(TEXT))[:tokens]
    nll, count, top = 0.0, 0, []
    with torch.no_grad():
        for a in range(0, len(ids) - 1, CHUNK):
            x = torch.tensor(ids[a:a + CHUNK])
            if len(x) < 2:
                break
            logits = model(input_ids=x[None]).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits[:-1], x[1:], reduction="sum").item()
            count += len(x) - 1
            top.append(logits.argmax(-1).numpy())
    np.save(out + ".ids.npy", np.array(ids, dtype=np.int64))
    np.save(out + ".top.npy", np.concatenate(top))
    held = sum(l.experts.npumoe_weights.stored_bytes() if hasattr(l.experts, "npumoe_weights") else
               sum(p.numel() * p.element_size() for p in l.experts.parameters()) for l in moe_layers(model))
    return {"ppl": float(np.exp(nll / count)), "tokens": len(ids), "expert_bytes_held": int(held),
            "prompt_ids": tokenizer.encode(PROMPT), "report": getattr(model, "npumoe_gguf_report", {}),
            "weights_held_mb": weights / 2**20,
            "weights_predicted_mb": model_size(resolve_model(file, "float32")).weight_bytes / 2**20,
            "rss_before_load_mb": before, "peak_rss_after_load_mb": loaded,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def llama_worker(lib: str, sdist: str, file: str, out: str, prompt_ids: str) -> dict:
    """llama.cpp's own forward of the file (llama-cpp-python's bindings from the source package): perplexity and
    argmax on our token ids, its tokenization of the text, and its greedy tokens after the prompt."""
    import numpy as np

    sys.path.insert(0, sdist)
    from llama_cpp import Llama

    from autotune.calibration.texts import read_text

    ids = np.load(out + ".ids.npy").tolist()
    llm = Llama(model_path=file, n_ctx=CHUNK, n_batch=CHUNK, n_ubatch=CHUNK, logits_all=True, n_threads=1,
                verbose=False)
    nll, count, top = 0.0, 0, []
    for a in range(0, len(ids) - 1, CHUNK):
        chunk = ids[a:a + CHUNK]
        if len(chunk) < 2:
            break
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:len(chunk)], dtype=np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= logp[np.arange(len(chunk) - 1), chunk[1:]].sum()
        count += len(chunk) - 1
        top.append(logits.argmax(-1))
    np.save(out + ".llama_top.npy", np.concatenate(top))
    theirs = llm.tokenize(read_text(TEXT).encode("utf-8"), add_bos=False, special=False)[:len(ids)]
    llm.reset()
    greedy, seq = [], json.loads(prompt_ids)
    llm.eval(seq)
    for _ in range(GREEDY_TOKENS):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    return {"ppl": float(np.exp(nll / count)), "same_tokenization": theirs == ids, "greedy": greedy}


def expert_bytes_in_file(file: Path) -> int:
    from runtime.loading.gguf_file import GGUFFile

    return sum(n_bytes for name, (_, _, _, n_bytes) in GGUFFile(file).tensors.items() if "_exps." in name)


def autotune(*argv: str, json_out: bool = True) -> tuple[int, dict | None, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "autotune.cli", *argv, *(["--json"] if json_out else [])], env=env,
                          capture_output=True, text=True)
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        out = None
    return proc.returncode, out, proc.stderr.strip()[-600:]


def ours_entry(quant: str, file: Path, tokens: int, work: Path) -> tuple[dict, dict]:
    """Our reader's figures of the file (its own process): the entry's keys, and the worker's whole answer."""
    ours = worker("ours", [str(file), str(tokens), str(work / quant)])
    held, stored = ours["expert_bytes_held"], expert_bytes_in_file(file)
    return {"quant": quant, "file": str(file), "file_mb": round(file.stat().st_size / 2**20, 2),
            "tokens": ours["tokens"], "ppl_ours": round(ours["ppl"], 4),
            "expert_bytes_held": held, "expert_bytes_in_file": stored, "held_over_file": round(held / stored, 4),
            "peak_rss_mb": round(ours["peak_rss_mb"], 1), "rss_before_load_mb": round(ours["rss_before_load_mb"], 1),
            "peak_rss_after_load_mb": round(ours["peak_rss_after_load_mb"], 1),
            "weights_held_mb": round(ours["weights_held_mb"], 2),
            "weights_predicted_mb": round(ours["weights_predicted_mb"], 2),
            "tensors": {t: sum(1 for r in ours["report"].values() if r["type"] == t)
                        for t in sorted({r["type"] for r in ours["report"].values()})},
            "max_fp16_rounding": max((r["fp16_rounding"] for r in ours["report"].values()), default=0.0),
            "max_requant_error": max((r["requant_error"] for r in ours["report"].values()), default=0.0),
            "prompt_ids": ours["prompt_ids"]}, ours


def bench_file(bin_dir: Path, sdist: Path, quant: str, file: Path, tokens: int, work: Path) -> dict:
    """Our figures of the file beside llama.cpp's on the same token ids."""
    import numpy as np

    entry, ours = ours_entry(quant, file, tokens, work)
    base = str(work / quant)
    ref = worker("llama", [str(bin_dir), str(sdist), str(file), base, json.dumps(ours["prompt_ids"])])
    top, theirs = np.load(base + ".top.npy"), np.load(base + ".llama_top.npy")
    return {**entry, "ppl_llama_cpp": round(ref["ppl"], 4), "ppl_rel_diff": round(ours["ppl"] / ref["ppl"] - 1, 6),
            "top1_vs_llama_cpp": round(float((top == theirs).mean()), 4),
            "same_tokenization": ref["same_tokenization"], "llama_cpp_greedy": ref["greedy"]}


def search_and_generate(entry: dict, work: Path, search: bool) -> None:
    """`autotune search` on the file (its gate), or a template plan, then `autotune generate` under the plan
    against llama.cpp's greedy tokens."""
    file, plan = entry["file"], work / f"{entry['quant']}-plan.json"
    if search:
        code, out, err = autotune("search", "--model", file, "--profile", PROFILE, "--out", str(plan),
                                  "--threads", "1")
        gate = (out or {}).get("gate") if isinstance(out, dict) else None
        entry["search"] = {"exit": code, "plan_written": plan.exists(), "gate": gate, "stderr": err if code else ""}
    else:
        code, _, err = autotune("plan-template", "--model", file, "--out", str(plan), json_out=False)
        entry["plan_template"] = {"exit": code, "stderr": err if code else ""}
    if not plan.exists():
        return
    code, out, err = autotune("generate", "--model", file, "--plan", str(plan), "--prompt", PROMPT,
                              "--max-tokens", str(GREEDY_TOKENS), "--dtype", "float32", "--threads", "1")
    ours = (out or {}).get("token_ids", [])
    theirs = entry.get("llama_cpp_greedy", [])  # --files: no reference, the tokens alone
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    same = ours == theirs[:len(ours)] and len(ours) > 0
    out = out or {}
    entry["generate"] = {"exit": code, "plan": plan.name, "tokens_ours": ours, "tokens_llama_cpp": theirs,
                         "same_tokens": same if theirs else None, "agree_first": agree if theirs else None,
                         "finish_reason": out.get("finish_reason"), "peak_rss_mb": out.get("peak_rss_mb"),
                         "memory": out.get("memory"), "stderr": err if code else ""}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        kind, rest = sys.argv[2], sys.argv[3:]
        workers = {"ours": lambda: ours_worker(rest[0], int(rest[1]), rest[2]), "llama": lambda: llama_worker(*rest),
                   "quantize": lambda: quantize_worker(*rest)}
        result = workers[kind]()
        print(json.dumps(result))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quants", default="Q8_0,Q4_K_M", help="llama-quantize types (default Q8_0,Q4_K_M)")
    p.add_argument("--tokens", type=int, default=4096, help=f"tokens of {TEXT} (default 4096)")
    p.add_argument("--source", type=Path, help="a transformers MoE folder to convert instead of tiny-moe (a shape "
                   "twin, for memory: scripts/make_shape_twin.py)")
    p.add_argument("--no-search", action="store_true", help="skip search and generate")
    p.add_argument("--cache", type=Path, default=default_cache(), help="llama.cpp's build and the files")
    p.add_argument("--jobs", type=int, default=2, help="build jobs (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--files", help="GGUF files (comma-separated) to run our side on alone: no llama.cpp build, no "
                   "reference figures")
    args = p.parse_args()
    if args.files:
        require("bench_gguf.py", "gguf")
        return ours_alone([Path(f) for f in args.files.split(",")], args)
    require("bench_gguf.py", "diskcache", "jinja2", "gguf")
    bin_dir = build_llama_cpp(args.cache, args.jobs)
    sdist = source_package(args.cache)
    llama = sdist / "vendor" / "llama.cpp"
    files_dir = args.cache / "files"
    files_dir.mkdir(parents=True, exist_ok=True)
    from runtime.loading.model_loader import TINY_MOE_DIR

    source = args.source or TINY_MOE_DIR
    f16 = convert_f16(llama, source, files_dir / f"{source.name}-F16.gguf")
    from runtime.loading.gguf_file import GGUFFile

    converted = GGUFFile(f16)
    result = {"llama_cpp_python": LLAMA_CPP_PYTHON, "text": TEXT, "chunk": CHUNK,
              "f16": {"file": str(f16), "tensors": len(converted.tensors),
                      "mb": round(f16.stat().st_size / 1e6, 1)}, "files": []}
    with tempfile.TemporaryDirectory() as tmp:
        for quant in args.quants.split(","):
            file = quantize(bin_dir, sdist, f16, quant, files_dir / f"{source.name}-{quant}.gguf")
            log(f"{quant}: ours against llama.cpp")
            entry = bench_file(bin_dir, sdist, quant, file, args.tokens, Path(tmp))
            if not args.no_search:
                search_and_generate(entry, Path(tmp), search=quant == "Q4_K_M")
            result["files"].append(entry)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


def ours_alone(files: list[Path], args: argparse.Namespace) -> int:
    """--files: steps 3 and 4 on our side alone, generate under a template plan (a search calibrates for minutes)."""
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        print(f"bench_gguf.py: no such GGUF file: {', '.join(absent)}", file=sys.stderr)
        return 2
    result = {"text": TEXT, "chunk": CHUNK, "llama_cpp": None, "files": []}
    with tempfile.TemporaryDirectory() as tmp:
        for file in files:
            log(f"{file.name}: ours alone")
            entry, _ = ours_entry(file.stem, file, args.tokens, Path(tmp))
            if not args.no_search:
                search_and_generate(entry, Path(tmp), search=False)
            result["files"].append(entry)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GGUF files for the tests, written by the `gguf` package's own writer from tiny-moe's safetensors checkpoint as
llama.cpp's convert_hf_to_gguf.py lays them out (qwen3moe: metadata keys, tensor names, experts stacked [E, rows,
n], the byte-level BPE vocabulary), each matrix in a type the package quantizes (Q8_0, Q4_0, F16, ...)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.loading.model_loader import TINY_MOE_DIR

LAYER_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def tiny_moe_tensors() -> dict[str, np.ndarray]:
    """tiny-moe's weights by GGUF tensor name, float32, experts stacked [E, rows, n]."""
    import torch
    from safetensors.torch import load_file

    src = {k: v.to(torch.float32).numpy() for k, v in load_file(TINY_MOE_DIR / "model.safetensors").items()}
    config = json.loads((TINY_MOE_DIR / "config.json").read_text())
    out = {"token_embd.weight": src["model.embed_tokens.weight"], "output_norm.weight": src["model.norm.weight"]}
    for i in range(config["num_hidden_layers"]):
        base = f"model.layers.{i}."
        for hf, gg in LAYER_PARTS.items():
            out[f"blk.{i}.{gg}.weight"] = src[f"{base}{hf}.weight"]
        for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            out[f"blk.{i}.{gg}.weight"] = np.stack([src[f"{base}mlp.experts.{e}.{hf}.weight"]
                                                    for e in range(config["num_experts"])])
    return out


def tiny_moe_metadata(arch: str = "qwen3moe") -> dict[str, tuple[object, str]]:
    """tiny-moe's GGUF metadata as convert_hf_to_gguf.py writes it: key -> (value, gguf value type name)."""
    config = json.loads((TINY_MOE_DIR / "config.json").read_text())
    vocab = json.loads((TINY_MOE_DIR / "tokenizer.json").read_text())
    tokens = sorted(vocab["model"]["vocab"], key=vocab["model"]["vocab"].get)
    a = arch + "."
    return {
        a + "block_count": (config["num_hidden_layers"], "UINT32"),
        a + "context_length": (config["max_position_embeddings"], "UINT32"),
        a + "embedding_length": (config["hidden_size"], "UINT32"),
        a + "feed_forward_length": (config["intermediate_size"], "UINT32"),
        a + "attention.head_count": (config["num_attention_heads"], "UINT32"),
        a + "attention.head_count_kv": (config["num_key_value_heads"], "UINT32"),
        a + "attention.key_length": (config["head_dim"], "UINT32"),
        a + "attention.value_length": (config["head_dim"], "UINT32"),
        a + "rope.freq_base": (config["rope_parameters"]["rope_theta"], "FLOAT32"),
        a + "attention.layer_norm_rms_epsilon": (config["rms_norm_eps"], "FLOAT32"),
        a + "expert_count": (config["num_experts"], "UINT32"),
        a + "expert_used_count": (config["num_experts_per_tok"], "UINT32"),
        a + "expert_feed_forward_length": (config["moe_intermediate_size"], "UINT32"),
        "tokenizer.ggml.model": ("gpt2", "STRING"),
        "tokenizer.ggml.pre": ("gpt-2", "STRING"),
        "tokenizer.ggml.tokens": (tokens, "STRING"),
        "tokenizer.ggml.token_type": ([3 if t == "<|endoftext|>" else 1 for t in tokens], "INT32"),
        "tokenizer.ggml.merges": ([" ".join(m) for m in vocab["model"]["merges"]], "STRING"),
        "tokenizer.ggml.bos_token_id": (config["bos_token_id"], "UINT32"),
        "tokenizer.ggml.eos_token_id": (config["eos_token_id"], "UINT32"),
    }


def write_tiny_moe_gguf(out: Path, matrix_type: str = "Q8_0", arch: str = "qwen3moe",
                        tensors: dict[str, np.ndarray] | None = None,
                        metadata: dict[str, tuple[object, str]] | None = None) -> Path:
    """tiny-moe as a GGUF file at `out`: matrices (2D and 3D) in `matrix_type`, the rest F32 (the router too, as
    llama.cpp keeps it); `metadata` replaces or adds keys (value, type name)."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    for key, (value, type_name) in {**tiny_moe_metadata(arch), **(metadata or {})}.items():
        if value is None:  # a key left out
            continue
        vtype = gguf.GGUFValueType[type_name]
        if isinstance(value, list):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=vtype)
        else:
            w.add_key_value(key, value, vtype)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, value in (tiny_moe_tensors() if tensors is None else tensors).items():
        if value.ndim >= 2 and "ffn_gate_inp" not in name and matrix_type != "F32":
            if matrix_type == "F16":
                w.add_tensor(name, value.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` of q_proj / k_proj rows (each head's two rope halves
    interleaved, for llama.cpp's rope)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mixtral_tensors(model) -> dict[str, np.ndarray]:
    """A transformers Mixtral model's weights by GGUF tensor name (llama arch), q/k permuted as the converter does."""
    cfg = model.config
    p = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": p["model.embed_tokens.weight"], "output_norm.weight": p["model.norm.weight"],
           "output.weight": p["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        b = f"model.layers.{i}."
        f = p[b + "mlp.experts.down_proj"].shape[-1]
        out.update({
            f"blk.{i}.attn_norm.weight": p[b + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": p[b + "post_attention_layernorm.weight"],
            f"blk.{i}.attn_q.weight": permute_for_llama_cpp(p[b + "self_attn.q_proj.weight"], cfg.num_attention_heads),
            f"blk.{i}.attn_k.weight": permute_for_llama_cpp(p[b + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
            f"blk.{i}.attn_v.weight": p[b + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": p[b + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate_inp.weight": p[b + "mlp.gate.weight"],
            f"blk.{i}.ffn_gate_exps.weight": p[b + "mlp.experts.gate_up_proj"][:, :f],
            f"blk.{i}.ffn_up_exps.weight": p[b + "mlp.experts.gate_up_proj"][:, f:],
            f"blk.{i}.ffn_down_exps.weight": p[b + "mlp.experts.down_proj"]})
    return out


def mixtral_metadata(model) -> dict[str, tuple[object, str]]:
    cfg = model.config
    keys = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok}
    out = {f"llama.{k}": (v, "UINT32") for k, v in keys.items()}
    out["llama.rope.freq_base"] = (float(cfg.rope_parameters["rope_theta"]), "FLOAT32")
    out["llama.attention.layer_norm_rms_epsilon"] = (float(cfg.rms_norm_eps), "FLOAT32")
    return out

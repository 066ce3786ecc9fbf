"""What a GGUF file describes, as the transformers model we run: its config from the metadata (the routing as
llama.cpp runs it), each module parameter's tensor in the file, and the file's checks against that model.

Architectures: qwen3moe, qwen2moe, olmoe, and llama with experts (Mixtral; its q/k rows were permuted for
llama.cpp's rope by convert_hf_to_gguf.py and are put back here).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from runtime.errors import NpumoeError
from runtime.loading.gguf_file import GGUFFile
from runtime.loading.gguf_quants import EXACT, HALF_WIDTHS
from runtime.loading.model_config import check_facts


@dataclass(frozen=True)
class Arch:
    model_type: str
    architecture: str
    norm_topk_prob: bool  # llama.cpp's `norm_w` in build_moe_ffn for the architecture (whatever the key says)
    permuted_qk: bool  # convert_hf_to_gguf.py permuted q_proj/k_proj rows (LlamaModel.permute)


ARCHS = {"qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", True, False),
         "qwen2moe": Arch("qwen2_moe", "Qwen2MoeForCausalLM", False, False),
         "olmoe": Arch("olmoe", "OlmoeForCausalLM", False, False),
         "llama": Arch("mixtral", "MixtralForCausalLM", True, True)}
EXPERT_FIELD = {"num_experts": ("qwen3_moe", "qwen2_moe", "olmoe"), "num_local_experts": ("mixtral",)}
# config field -> the metadata key (after `<arch>.`) it is read from: what a refusal of the field names
CONFIG_KEYS = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
               "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
               "head_dim": "attention.key_length", "max_position_embeddings": "context_length",
               "num_experts_per_tok": "expert_used_count", "num_experts": "expert_count",
               "num_local_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
               "intermediate_size": "feed_forward_length"}

# transformers parameter (layer index as {i}) -> GGUF tensor; the fused experts are `EXPERT_PARTS`.
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def gguf_name(param: str) -> str | None:
    """The GGUF tensor holding transformers parameter `param` (not the fused experts), None if none does."""
    if param in _NAMES:
        return _NAMES[param]
    m = _LAYER.match(param)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def architecture(file: GGUFFile) -> tuple[str, Arch]:
    name = file.value("general.architecture", "str")
    if name not in ARCHS:
        raise NpumoeError(f"{file.path}: architecture {name!r} is not one this reader runs (it runs "
                          f"{', '.join(ARCHS)} with experts)")
    return name, ARCHS[name]


def _tensor_dim(file: GGUFFile, name: str, axis: int) -> int | None:
    entry = file.tensors.get(name)
    return entry[1][axis] if entry else None


def hf_config(file: GGUFFile) -> dict:
    """The transformers config.json of the model the file holds, from its metadata (sizes the metadata leaves out
    from the tensors' shapes), its facts checked as every format's are (`model_config.check_facts`)."""
    arch_name, arch = architecture(file)
    p = arch_name + "."
    experts = file.value(p + "expert_count", "int", 0)
    if not experts:
        raise NpumoeError(f"{file.path}: a {arch_name} model without experts ({p}expert_count): not an MoE model")
    file.value(p + "expert_weights_norm", "bool", False)  # type-checked; llama.cpp's graph decides (`Arch`)
    hidden, heads = file.value(p + "embedding_length", "int"), file.value(p + "attention.head_count", "int")
    expert_ffn = file.value(p + "expert_feed_forward_length", "int", None) or \
        _tensor_dim(file, "blk.0.ffn_gate_exps.weight", 1) or file.value(p + "feed_forward_length", "int")
    vocab = _tensor_dim(file, "token_embd.weight", 0)
    tokens = file.value("tokenizer.ggml.tokens", "strs", None)
    config = dict(
        architectures=[arch.architecture], model_type=arch.model_type, dtype="float32",
        hidden_size=hidden, num_hidden_layers=file.value(p + "block_count", "int"), num_attention_heads=heads,
        num_key_value_heads=file.value(p + "attention.head_count_kv", "int", heads),
        head_dim=file.value(p + "attention.key_length", "int", hidden // heads if heads else None),
        rms_norm_eps=float(file.value(p + "attention.layer_norm_rms_epsilon", "float")),
        rope_parameters={"rope_type": "default", "rope_theta": float(file.value(p + "rope.freq_base", "float",
                                                                                10000.0))},
        max_position_embeddings=file.value(p + "context_length", "int"), vocab_size=vocab or len(tokens or ()),
        tie_word_embeddings="output.weight" not in file.tensors,
        num_experts_per_tok=file.value(p + "expert_used_count", "int"), norm_topk_prob=arch.norm_topk_prob,
        intermediate_size=expert_ffn)
    for key in ("bos", "eos", "padding"):
        value = file.value(f"tokenizer.ggml.{key}_token_id", "int", None)
        if value is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = value
    field = next(f for f, types in EXPERT_FIELD.items() if arch.model_type in types)
    config[field] = experts
    if arch.model_type in ("qwen3_moe", "qwen2_moe"):
        config.update(moe_intermediate_size=expert_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                      intermediate_size=file.value(p + "feed_forward_length", "int", expert_ffn))
    if arch.model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = file.value(p + "expert_shared_feed_forward_length", "int",
                                                               None) or _tensor_dim(file, "blk.0.ffn_gate_shexp.weight",
                                                                                    0)
    check_facts(config, str(file.path), {field: p + key for field, key in CONFIG_KEYS.items()})
    return config


def qk_row_order(arch: Arch, config: dict, param: str) -> np.ndarray | None:
    """Where a llama-arch q_proj/k_proj row sits in the file (convert_hf_to_gguf.py interleaved each head's two
    rope halves); None for other parameters and architectures."""
    if not arch.permuted_qk or not param.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        return None
    heads = config["num_attention_heads"] if ".q_proj." in param else config["num_key_value_heads"]
    half = config["head_dim"] // 2
    return np.arange(heads * 2 * half).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def expected_tensors(skeleton: object) -> dict[str, tuple[str, list[int]]]:
    """GGUF tensor -> (the parameter it fills, its shape there) for a meta-device model; the fused experts as
    their three GGUF parts."""
    tied = skeleton.config.get_text_config().tie_word_embeddings
    out = {}
    for param, p in skeleton.named_parameters():
        if param.endswith(".mlp.experts.gate_up_proj"):
            layer = param.split(".")[2]
            e, two_f, h = p.shape
            out[f"blk.{layer}.ffn_gate_exps.weight"] = (param, [e, two_f // 2, h])
            out[f"blk.{layer}.ffn_up_exps.weight"] = (param, [e, two_f // 2, h])
        elif param.endswith(".mlp.experts.down_proj"):
            out[f"blk.{param.split('.')[2]}.ffn_down_exps.weight"] = (param, list(p.shape))
        elif not (tied and param == "lm_head.weight"):
            name = gguf_name(param)
            if name is None:
                raise NpumoeError(f"{param}: no GGUF tensor is known to hold it")
            out[name] = (param, list(p.shape))
    return out


def check_tensors(file: GGUFFile, skeleton: object) -> str:
    """Every tensor the model needs is in the file with its shape and a type we read, and the file holds nothing
    else; returns each tensor's type as canonical JSON (what the model fingerprint covers)."""
    expected = expected_tensors(skeleton)
    for name, (param, shape) in expected.items():
        if name not in file.tensors:
            raise NpumoeError(f"{file.path}: tensor {name} (for {param}) is missing")
        type_name, stored, _, _ = file.tensors[name]
        if int(np.prod(stored)) != int(np.prod(shape)) or stored[-1] != shape[-1]:
            raise NpumoeError(f"{file.path}: tensor {name} has shape {stored}, the metadata's model needs {shape}")
        if type_name not in EXACT and type_name not in HALF_WIDTHS and type_name not in REQUANTIZED:
            raise NpumoeError(f"{file.path}: tensor {name} is {type_name}, a type this reader cannot decode")
    extra = sorted(set(file.tensors) - set(expected))
    if extra:
        raise NpumoeError(f"{file.path}: tensor {extra[0]} has no place in the {skeleton.config.model_type} model "
                          "the metadata describes")
    return json.dumps({name: file.tensors[name][0] for name in sorted(expected)}, sort_keys=True)


# types the gguf package dequantizes (then held as 8-bit groups: `gguf_quants.requantize`)
REQUANTIZED = {"Q2_K", "Q3_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
               "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"}

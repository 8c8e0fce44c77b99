"""Hugging Face Llama / Qwen2 checkpoints <-> the Megatron ``GPTModel`` of :mod:`speechtrain.speechlm.backbone`.

Names (HF ``model.layers.{i}.`` -> Megatron ``decoder.layers.{i}.``)::

    model.embed_tokens.weight                 embedding.word_embeddings.weight      (vocab rows split over TP)
    input_layernorm.weight                    input_layernorm.weight                (TE: linear_qkv.layer_norm_weight)
    self_attn.{q,k,v}_proj.{weight,bias}      self_attention.linear_qkv.{weight,bias}
    self_attn.o_proj.weight                   self_attention.linear_proj.weight     (input columns split over TP)
    post_attention_layernorm.weight           pre_mlp_layernorm.weight              (TE: linear_fc1.layer_norm_weight)
    mlp.{gate,up}_proj.weight                 mlp.linear_fc1.weight
    mlp.down_proj.weight                      mlp.linear_fc2.weight                 (input columns split over TP)
    model.norm.weight                         decoder.final_layernorm.weight
    lm_head.weight                            output_layer.weight                   (absent when embeddings are tied)

Layouts: ``linear_qkv`` rows are grouped by KV head, each group holding its query heads, then its key head, then its
value head ([q_g0 | k_g0 | v_g0 | q_g1 | ...]); the groups are contiguous, so TP rank r holds groups r/tp..(r+1)/tp.
``linear_fc1`` is [gate; up] in full, [gate_r; up_r] on TP rank r (Megatron's ``partition_stride`` 2). The
conversions below work on full tensors, the layout of a one-process model;
:func:`speechtrain.lightning.checkpoint.shard_full_state_dict` and ``gather_full_state_dict`` go between them and
the TP shards.
"""

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from speechtrain.lightning import parallel_state
from speechtrain.lightning.checkpoint import gather_full_state_dict, shard_full_state_dict
from speechtrain.speechlm.backbone import GPTConfig, build_gpt

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def gpt_config_from_hf(folder: str | Path, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Llama- or Qwen2-style ``config.json``; ValueError for what we cannot represent."""
    hf = json.loads((Path(folder) / "config.json").read_text())
    kind = hf.get("model_type")
    if kind not in _ARCHITECTURES:
        raise ValueError(f"config.json: model_type={kind!r} is not supported (only 'llama' or 'qwen2').")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    # transformers < 5 writes rope_theta (+ rope_scaling); 5.x writes rope_parameters {rope_type, rope_theta}.
    rope_field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_field) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = {
        rope_field: hf.get(rope_field) if rope_type != "default" else None,
        "head_dim": hf.get("head_dim") if hf.get("head_dim") not in (None, hidden // heads) else None,
        "mlp_bias": hf.get("mlp_bias") or None,
        "hidden_act": hf.get("hidden_act") if hf.get("hidden_act", "silu") != "silu" else None,
        "attention_bias": (hf.get("attention_bias") or None) if kind == "llama" else None,  # llama: o_proj bias too
        "use_sliding_window": hf.get("use_sliding_window") or None,
    }
    for field, value in problems.items():
        if value is not None:
            raise ValueError(f"config.json: {field}={value!r} is not supported by speechtrain's GPT backbone.")
    if hidden % heads:
        raise ValueError(f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads}.")
    cfg = GPTConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2",
        architecture=kind,
    )
    return dataclasses.replace(cfg, **overrides)


def _check_parallel(cfg: GPTConfig) -> int:
    tp = parallel_state.tensor_parallel_world_size()
    if parallel_state.pipeline_parallel_world_size() > 1:
        raise ValueError("HF import/export does not support pipeline parallelism (pipeline_model_parallel_size > 1).")
    if cfg.vocab_size % tp:
        raise ValueError(
            f"vocab_size={cfg.vocab_size} is not divisible by tensor_model_parallel_size={tp}: Megatron's "
            "vocab-parallel embedding needs equal shares. Use a TP size that divides the vocabulary."
        )
    return tp


def _megatron_names(model: torch.nn.Module) -> tuple[str, str]:
    """Where the two per-layer norms live: local spec (own modules) or TE spec (fused into the next linear)."""
    if any(k.endswith("self_attention.linear_qkv.layer_norm_weight") for k in model.state_dict()):
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def _hf_to_megatron(hf: dict[str, torch.Tensor], cfg: GPTConfig, norms: tuple[str, str]) -> dict:
    """Full Megatron tensors from HF tensors; pops what it uses from ``hf``."""
    groups, per_group, dim = cfg.kv_heads, cfg.num_attention_heads // cfg.kv_heads, cfg.head_dim
    out = {"embedding.word_embeddings.weight": hf.pop("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": hf.pop("model.norm.weight")}  # fmt: skip
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf.pop("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + norms[0]] = hf.pop(src + "input_layernorm.weight")
        out[dst + norms[1]] = hf.pop(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (hf.pop(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
            rest = q.shape[1:]
            qkv = [
                q.reshape(groups, per_group * dim, *rest),
                k.reshape(groups, dim, *rest),
                v.reshape(groups, dim, *rest),
            ]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat(qkv, dim=1).reshape(-1, *rest)
        out[dst + "self_attention.linear_proj.weight"] = hf.pop(src + "self_attn.o_proj.weight")
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf.pop(src + "mlp.gate_proj.weight"),
                                                        hf.pop(src + "mlp.up_proj.weight")])  # fmt: skip
        out[dst + "mlp.linear_fc2.weight"] = hf.pop(src + "mlp.down_proj.weight")
    return out


def _megatron_to_hf(meg: dict[str, torch.Tensor], cfg: GPTConfig, norms: tuple[str, str]) -> dict:
    """HF tensors from full Megatron tensors."""
    groups, per_group, dim = cfg.kv_heads, cfg.num_attention_heads // cfg.kv_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": meg["embedding.word_embeddings.weight"],
           "model.norm.weight": meg["decoder.final_layernorm.weight"]}  # fmt: skip
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = meg["output_layer.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = meg[src + norms[0]]
        out[dst + "post_attention_layernorm.weight"] = meg[src + norms[1]]
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            qkv = meg[f"{src}self_attention.linear_qkv.{kind}"]
            rest = qkv.shape[1:]
            q, k, v = qkv.reshape(groups, (per_group + 2) * dim, *rest).split([per_group * dim, dim, dim], dim=1)
            for name, part in zip("qkv", (q, k, v)):
                out[f"{dst}self_attn.{name}_proj.{kind}"] = part.reshape(-1, *rest)
        out[dst + "self_attn.o_proj.weight"] = meg[src + "self_attention.linear_proj.weight"]
        gate, up = meg[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = meg[src + "mlp.linear_fc2.weight"]
    return out


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: neither model.safetensors nor model.safetensors.index.json found.")
    tensors = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as reader:
            tensors.update({key: reader.get_tensor(key) for key in reader.keys()})  # noqa: SIM118
    return tensors


def load_hf_weights(model: torch.nn.Module, folder: str | Path, cfg: GPTConfig) -> None:
    """Fill ``model`` (this TP rank's shards) from the safetensors of an HF folder; every weight must be used."""
    _check_parallel(cfg)
    hf = _read_safetensors(Path(folder))
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    try:
        full = _hf_to_megatron(hf, cfg, _megatron_names(model))
    except KeyError as error:
        raise ValueError(f"{folder}: HF tensor {error.args[0]} is missing from the checkpoint.") from None
    if hf:
        raise ValueError(f"{folder}: unexpected HF tensors (not loaded): {sorted(hf)}")
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if set(full) != set(expected):
        raise ValueError(f"HF -> Megatron names: missing {sorted(set(expected) - set(full))}, "
                         f"unexpected {sorted(set(full) - set(expected))}")  # fmt: skip
    state = shard_full_state_dict(model, full)
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{name}: HF gives shape {tuple(tensor.shape)}, model has {tuple(expected[name].shape)}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"load_state_dict: missing {missing}, unexpected {unexpected}")


def hf_config_dict(cfg: GPTConfig) -> dict[str, Any]:
    """A ``config.json`` for transformers (4.x reads ``rope_theta``, 5.x ``rope_parameters``)."""
    if cfg.architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture={cfg.architecture!r}: export supports only 'llama' or 'qwen2'.")
    if cfg.architecture == "llama" and cfg.qkv_bias:
        raise ValueError("architecture='llama' cannot hold q/k/v biases without an o_proj bias; export as 'qwen2'.")
    config = {
        "architectures": [_ARCHITECTURES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if cfg.architecture == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return config


def export_hf(model: torch.nn.Module, cfg: GPTConfig, out_dir: str | Path, tokenizer_dir: str | Path | None = None):
    """Write ``config.json`` + ``model.safetensors`` (float32) for transformers. Collective: every rank calls it
    (the TP shards are all-gathered); global rank 0 writes. Tokenizer files are copied from ``tokenizer_dir``."""
    from safetensors.torch import save_file

    config = hf_config_dict(cfg)
    _check_parallel(cfg)
    hf = _megatron_to_hf(gather_full_state_dict(model), cfg, _megatron_names(model))
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        source = Path(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out_dir / name)
        if (source / "config.json").is_file():  # keep the special token ids of the original model
            original = json.loads((source / "config.json").read_text())
            config.update({k: original[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in original})
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in hf.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def import_hf(folder: str | Path, **overrides: Any) -> tuple[torch.nn.Module, GPTConfig]:
    """Build the Megatron GPT of an HF Llama / Qwen2 folder and load its weights (parallel state must be set up)."""
    cfg = gpt_config_from_hf(folder, **overrides)
    _check_parallel(cfg)
    model = build_gpt(cfg)
    load_hf_weights(model, folder, cfg)
    return model, cfg

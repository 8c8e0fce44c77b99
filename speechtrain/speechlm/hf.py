"""Hugging Face Llama / Qwen2 / Qwen3 checkpoints <-> Megatron's ``GPTModel`` of :mod:`speechtrain.speechlm.backbone`.

Names (HF ``model.layers.{i}.`` -> Megatron ``decoder.layers.{i}.``)::

    model.embed_tokens.weight                 embedding.word_embeddings.weight      (vocab rows split over TP)
    input_layernorm.weight                    input_layernorm.weight                (TE: linear_qkv.layer_norm_weight)
    self_attn.{q,k,v}_proj.{weight,bias}      self_attention.linear_qkv.{weight,bias}
    self_attn.{q,k}_norm.weight               self_attention.{q,k}_layernorm.weight (Qwen3; one head wide)
    self_attn.o_proj.weight                   self_attention.linear_proj.weight     (input columns split over TP)
    post_attention_layernorm.weight           pre_mlp_layernorm.weight              (TE: linear_fc1.layer_norm_weight)
    mlp.{gate,up}_proj.weight                 mlp.linear_fc1.weight
    mlp.down_proj.weight                      mlp.linear_fc2.weight                 (input columns split over TP)
    model.norm.weight                         decoder.final_layernorm.weight
    lm_head.weight                            output_layer.weight                   (absent when embeddings are tied)

Layouts: ``linear_qkv`` rows are grouped by KV head, each group holding its query heads, then its key head, then its
value head ([q_g0 | k_g0 | v_g0 | q_g1 | ...]); the groups are contiguous, so TP rank r holds groups r/tp..(r+1)/tp.
``linear_fc1`` is [gate; up] in full, [gate_r; up_r] on TP rank r (Megatron's ``partition_stride`` 2). Every split
tensor of a TP rank is therefore built from equal, contiguous shares of HF tensors (rows, or columns for
``o_proj`` / ``down_proj``): loading reads just those shares with safetensors' slices. Export gathers the full
tensors (:func:`speechtrain.lightning.checkpoint.gather_full_state_dict`) and converts them.

``config.json``: ``rope_theta`` + ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (5.x; when both are
there ``rope_scaling`` wins, as in transformers). Rotary types ``default``, ``linear``, ``dynamic``, ``llama3`` and
``yarn`` are converted (:func:`speechtrain.speechlm.backbone.rope_frequencies`); others (``longrope``, ...), unknown
keys, partial rotary, sliding windows and biases the backbone lacks are refused by name.
"""

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from speechtrain.lightning import parallel_state
from speechtrain.lightning.checkpoint import gather_full_state_dict
from speechtrain.speechlm.backbone import ROPE_SCALING_KEYS, GPTConfig, build_gpt

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
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# transformers' defaults where config.json leaves a key out
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


def _rope_from_hf(hf: dict[str, Any], path: Path, max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a ``config.json``: the scaling dict in :class:`GPTConfig` form (``rope_type``
    and the type's keys, transformers' defaults filled in), None for plain RoPE."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(field) or {})
    theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    kind = rope.pop("rope_type", None) or rope.get("type") or "default"
    rope.pop("type", None)
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{path}: partial_rotary_factor={partial!r} is not supported (every head dimension rotates).")
    if kind == "default":
        if rope:
            raise ValueError(f"{path}: {field} keys {sorted(rope)} are not supported for rope_type='default'.")
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"{path}: {field}.rope_type={kind!r} is not supported by speechtrain's GPT backbone "
                         f"(supported: 'default', {', '.join(map(repr, ROPE_SCALING_KEYS))}).")  # fmt: skip
    required, optional = ROPE_SCALING_KEYS[kind]
    unknown = sorted(set(rope) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{path}: {field} keys {unknown} are not supported for rope_type={kind!r} "
                         f"(known: {[*required, *optional]}).")  # fmt: skip
    if "original_max_position_embeddings" in required:  # transformers: a top-level value wins, else the context
        rope["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", rope.get("original_max_position_embeddings") or max_positions
        )
    if kind == "yarn" and rope.get("factor") is None:  # transformers: the stretch from the original context
        rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    missing = [key for key in required if rope.get(key) is None]
    if missing:
        raise ValueError(f"{path}: {field} with rope_type={kind!r} needs {missing}.")
    return theta, {"rope_type": kind, **{k: rope[k] for k in (*required, *optional) if rope.get(k) is not None}}


def gpt_config_from_hf(folder: str | Path, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Llama-, Qwen2- or Qwen3-style ``config.json``; ValueError (naming the file and the
    key) for what the backbone cannot represent."""
    path = Path(folder) / "config.json"
    hf = json.loads(path.read_text())
    kind = hf.get("model_type")
    if kind not in _ARCHITECTURES:
        raise ValueError(f"{path}: model_type={kind!r} is not supported (one of {list(_ARCHITECTURES)}).")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(kind)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{path}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                             "(and no head_dim is given).")  # fmt: skip
        head_dim = hidden // heads
    max_positions = hf.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[kind]
    rope_theta, rope_scaling = _rope_from_hf(hf, path, max_positions)
    layer_types = hf.get("layer_types") or []
    problems = {
        "mlp_bias": hf.get("mlp_bias") or None,
        "hidden_act": hf.get("hidden_act") if hf.get("hidden_act", "silu") != "silu" else None,
        # llama and qwen3: attention_bias adds an o_proj bias too (qwen2 always has q/k/v biases, never o_proj's)
        "attention_bias": (hf.get("attention_bias") or None) if kind != "qwen2" else None,
        "use_sliding_window": hf.get("use_sliding_window") or None,
        "layer_types": layer_types if any(t != "full_attention" for t in layer_types) else None,
    }
    for field, value in problems.items():
        if value is not None:
            raise ValueError(f"{path}: {field}={value!r} is not supported by speechtrain's GPT backbone.")
    cfg = GPTConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=max_positions,
        rope_theta=rope_theta,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2",
        kv_channels=None if head_dim * heads == hidden else head_dim,
        qk_layernorm=kind == "qwen3",
        rope_scaling=rope_scaling,
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


def _hf_to_megatron(take: Any, cfg: GPTConfig, norms: tuple[str, str], tp: int) -> dict[str, torch.Tensor]:
    """This TP rank's Megatron tensors (of ``tp`` ranks); ``take(name, dim)`` gives the HF tensor ``name`` whole
    (``dim`` None) or this rank's equal share along ``dim``."""
    groups, per_group, dim = cfg.kv_heads // tp, cfg.num_attention_heads // cfg.kv_heads, cfg.head_dim
    rows, cols = 0, 1
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight", rows),
           "decoder.final_layernorm.weight": take("model.norm.weight", None)}  # fmt: skip
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = take("lm_head.weight", rows)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + norms[0]] = take(src + "input_layernorm.weight", None)
        out[dst + norms[1]] = take(src + "post_attention_layernorm.weight", None)
        if cfg.qk_layernorm:
            for p in "qk":
                out[f"{dst}self_attention.{p}_layernorm.weight"] = take(f"{src}self_attn.{p}_norm.weight", None)
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}", rows) for p in "qkv")
            rest = q.shape[1:]
            qkv = [
                q.reshape(groups, per_group * dim, *rest),
                k.reshape(groups, dim, *rest),
                v.reshape(groups, dim, *rest),
            ]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat(qkv, dim=1).reshape(-1, *rest)
        out[dst + "self_attention.linear_proj.weight"] = take(src + "self_attn.o_proj.weight", cols)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([take(src + "mlp.gate_proj.weight", rows),
                                                        take(src + "mlp.up_proj.weight", rows)])  # fmt: skip
        out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight", cols)
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
        if cfg.qk_layernorm:
            for p in "qk":
                out[f"{dst}self_attn.{p}_norm.weight"] = meg[f"{src}self_attention.{p}_layernorm.weight"]
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


class _CheckpointReader(contextlib.ExitStack):
    """The safetensors of an HF folder (single or sharded), one tensor at a time: whole, or TP rank ``rank``'s equal
    share along one dimension, read as a safetensors slice (no rank reads the others' shares). ``unused``: the
    names not taken yet."""

    def __init__(self, folder: Path, rank: int, size: int) -> None:
        from safetensors import safe_open

        super().__init__()
        self._safe_open, self.folder, self.rank, self.size = safe_open, folder, rank, size
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.where = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").exists():
            with safe_open(str(folder / "model.safetensors"), framework="pt") as reader:
                self.where = dict.fromkeys(reader.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{folder}: neither model.safetensors nor model.safetensors.index.json found.")
        self.unused = set(self.where)
        self._files: dict[str, Any] = {}

    def take(self, name: str, dim: int | None) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(name)
        self.unused.discard(name)
        file = self.where[name]
        if file not in self._files:
            self._files[file] = self.enter_context(self._safe_open(str(self.folder / file), framework="pt"))
        tensor = self._files[file].get_slice(name)
        if dim is None or self.size == 1:
            return tensor[:]
        length = tensor.get_shape()[dim]
        if length % self.size:
            raise ValueError(f"{self.folder / file}: {name} has {length} along dimension {dim}, not divisible by "
                             f"tensor_model_parallel_size={self.size}.")  # fmt: skip
        share = slice(self.rank * length // self.size, (self.rank + 1) * length // self.size)
        return tensor[share] if dim == 0 else tensor[:, share]


def load_hf_weights(model: torch.nn.Module, folder: str | Path, cfg: GPTConfig) -> None:
    """Fill ``model`` (this TP rank's shards) from the safetensors of an HF folder; every weight must be used. Each
    rank reads the replicated tensors and its own shares of the split ones only."""
    tp = _check_parallel(cfg)
    with _CheckpointReader(Path(folder), parallel_state.tensor_parallel_rank(), tp) as reader:
        reader.unused -= {k for k in reader.unused if k.endswith("rotary_emb.inv_freq")}
        if cfg.tie_word_embeddings:
            reader.unused.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
        try:
            state = _hf_to_megatron(reader.take, cfg, _megatron_names(model), tp)
        except KeyError as error:
            raise ValueError(f"{folder}: HF tensor {error.args[0]} is missing from the checkpoint.") from None
        if reader.unused:
            raise ValueError(f"{folder}: unexpected HF tensors (not loaded): {sorted(reader.unused)}")
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if set(state) != set(expected):
        raise ValueError(f"HF -> Megatron names: missing {sorted(set(expected) - set(state))}, "
                         f"unexpected {sorted(set(state) - set(expected))}")  # fmt: skip
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{name}: HF gives shape {tuple(tensor.shape)}, model has {tuple(expected[name].shape)}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"load_state_dict: missing {missing}, unexpected {unexpected}")


def hf_config_dict(cfg: GPTConfig) -> dict[str, Any]:
    """A ``config.json`` for transformers (4.x reads ``rope_theta`` and ``rope_scaling``, 5.x ``rope_parameters``);
    ValueError for a ``cfg`` the architecture it names cannot hold."""
    arch = cfg.architecture
    if arch not in _ARCHITECTURES:
        raise ValueError(f"architecture={arch!r}: export supports only {list(_ARCHITECTURES)}.")
    if cfg.qkv_bias != (arch == "qwen2"):
        raise ValueError(f"architecture={arch!r} with qkv_bias={cfg.qkv_bias}: only 'qwen2' has q/k/v biases "
                         "(and it always has them; the others' attention_bias adds an o_proj bias too).")  # fmt: skip
    if cfg.qk_layernorm != (arch == "qwen3"):
        raise ValueError(f"architecture={arch!r} with qk_layernorm={cfg.qk_layernorm}: only 'qwen3' has q/k norms "
                         "(and it always has them).")  # fmt: skip
    rope = {"rope_type": "default", **(cfg.rope_scaling or {})}
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
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
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling:
        config["rope_scaling"] = rope
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    if arch == "qwen3":
        config.update(attention_bias=False)
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
    """Build the Megatron GPT of an HF Llama / Qwen2 / Qwen3 folder and load its weights (parallel state must be set
    up)."""
    cfg = gpt_config_from_hf(folder, **overrides)
    _check_parallel(cfg)
    model = build_gpt(cfg)
    load_hf_weights(model, folder, cfg)
    return model, cfg

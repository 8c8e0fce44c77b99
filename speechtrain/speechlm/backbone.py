"""The LLM backbone: Megatron Core's ``GPTModel`` configured like a Llama / Qwen2 / Qwen3 decoder.

RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no linear biases except the optional QKV bias
(Qwen2), optional per-head RMSNorm of queries and keys and a head width of its own (Qwen3). Rotary scaling as
Hugging Face transformers defines it (``rope_scaling``: ``linear``, ``dynamic``, ``yarn``, ``llama3``) replaces the
inverse frequencies of Megatron's rotary embedding (see :func:`rope_frequencies`); YaRN's attention factor goes into
the softmax scale. The layer spec is Megatron's local one (plain PyTorch, runs on CPU); transformer-engine's spec
is used when transformer-engine is importable and CUDA is present (``transformer_engine: auto``), or required with
``transformer_engine: true``, which fails with a clear message when it is not installed.

Megatron's model needs an initialised parallel state even for one process: :func:`ensure_parallel_state` sets
up a single-process gloo group for scripts and tests that run outside a Lightning trainer.
"""

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from speechtrain.lightning.megatron_compat import import_megatron, model_parallel_manual_seed


@dataclass
class GPTConfig:
    """A decoder-only transformer in Hugging Face's Llama / Qwen2 / Qwen3 vocabulary (see
    :mod:`speechtrain.speechlm.hf`)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # grouped-query attention: number of KV heads (None = num_attention_heads)
    ffn_hidden_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on the q, k and v projections
    kv_channels: int | None = None  # width of one attention head (None = hidden_size / num_attention_heads)
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each query and key head, before the rotation
    # Rotary scaling in transformers' terms: {"rope_type": "linear" | "dynamic" | "yarn" | "llama3", "factor": ...,
    # and the type's other keys}; None = plain RoPE. See rope_frequencies.
    rope_scaling: dict[str, Any] | None = None
    architecture: str = "llama"  # "llama", "qwen2" or "qwen3": what export writes into config.json
    transformer_engine: Any = "auto"  # "auto" | true | false
    seed: int = 1234  # weight initialisation (the same full weights on every TP rank, then sliced)

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


def ensure_parallel_state(seed: int = 1234) -> None:
    """A one-process gloo group and Megatron parallel state, unless a trainer or launcher already set them up."""
    import torch.distributed as dist

    import_megatron()
    from megatron.core import parallel_state as mpu

    if not dist.is_initialized():
        # A private rendezvous (no MASTER_* variables set, so subprocesses launched later are not affected).
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
        model_parallel_manual_seed(seed)


def _use_transformer_engine(setting: Any) -> bool:
    if setting in (False, "false", "False"):
        return False
    try:
        import transformer_engine  # noqa: F401

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if setting in (True, "true", "True") and not available:
        raise RuntimeError(
            "llm.transformer_engine=true, but transformer-engine is not importable here (or CUDA is absent). "
            "Install the GPU extra (pip install 'speechtrain[gpu]') or set llm.transformer_engine=auto."
        )
    return available


# The keys each rotary scaling type reads besides rope_type (transformers' names); the required ones come first.
ROPE_SCALING_KEYS = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times: 1 + 0.1 ln(factor), weighted."""
    return 1.0 if factor <= 1.0 else 1.0 + 0.1 * mscale * math.log(factor)


def rope_frequencies(cfg: GPTConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies (``head_dim / 2``, float32) of ``cfg`` and the factor by which the rotated
    queries and keys are scaled (YaRN's attention factor; 1 for the other types), with the maths of transformers:

    - ``linear``: every frequency divided by ``factor`` (positions interpolated);
    - ``dynamic`` (NTK-aware): for a call over ``seq_len`` > ``max_position_embeddings`` positions the base grows to
      ``theta * (factor * seq_len / max_position_embeddings - factor + 1) ** (d / (d - 2))``; shorter: plain RoPE;
    - ``llama3``: wavelengths below ``original / high_freq_factor`` kept, above ``original / low_freq_factor``
      divided by ``factor``, a linear blend in ``original / wavelength`` between;
    - ``yarn``: the same blend between kept and divided frequencies, by index: the ramp runs from the index whose
      wavelength turns ``beta_fast`` times in the original context to the one turning ``beta_slow`` times (rounded
      outwards unless ``truncate`` is false); attention factor ``attention_factor``, else ``0.1 ln(factor) + 1``
      (with ``mscale`` / ``mscale_all_dim``: the ratio of the two corrections).
    """
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    dim = cfg.head_dim

    def plain(base: float) -> torch.Tensor:
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    if kind == "default":
        return plain(cfg.rope_theta), 1.0
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"llm.rope_scaling: rope_type={kind!r} is not supported (one of {list(ROPE_SCALING_KEYS)}).")
    missing = [key for key in ROPE_SCALING_KEYS[kind][0] if scaling.get(key) is None]
    if missing:
        raise ValueError(f"llm.rope_scaling: rope_type={kind!r} needs {missing} (given: {dict(scaling)}).")
    factor = float(scaling["factor"])
    inv_freq = plain(cfg.rope_theta)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        trained = cfg.max_position_embeddings
        if seq_len is None or seq_len <= trained:
            return inv_freq, 1.0
        return plain(cfg.rope_theta * (factor * seq_len / trained - factor + 1.0) ** (dim / (dim - 2))), 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        keep = ((original * inv_freq / (2 * math.pi) - low) / (high - low)).clamp(0.0, 1.0)
        return inv_freq * keep + inv_freq / factor * (1.0 - keep), 1.0

    def index(turns: float) -> float:  # yarn: the (fractional) frequency index whose wavelength fits `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    first, last = index(scaling.get("beta_fast") or 32), index(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)
    span = last - first if last != first else 1e-3
    divided = ((torch.arange(dim // 2, dtype=torch.float32) - first) / span).clamp(0.0, 1.0)
    inv_freq = inv_freq * (1.0 - divided) + inv_freq / factor * divided
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    return inv_freq, float(attention)


@functools.cache
def _scaled_rotary_embedding() -> type:
    """Megatron's ``RotaryEmbedding`` with the inverse frequencies of :func:`rope_frequencies` (recomputed for each
    sequence length, which only ``dynamic`` uses; Megatron caches the table per length)."""
    import_megatron()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class ScaledRotaryEmbedding(RotaryEmbedding):
        def __init__(self, cfg: GPTConfig) -> None:
            super().__init__(kv_channels=cfg.head_dim, rotary_percent=1.0, use_cpu_initialization=True)
            self.gpt_config = cfg
            self.inv_freq = rope_frequencies(cfg)[0]

        def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            # only ``dynamic`` depends on the length: the others keep the table of __init__ (no copy per call)
            if (self.gpt_config.rope_scaling or {}).get("rope_type") == "dynamic":
                self.inv_freq = rope_frequencies(self.gpt_config, max_seq_len + offset)[0].to(self.inv_freq.device)
            return super().get_freqs_non_repeated(max_seq_len, offset)

    return ScaledRotaryEmbedding


def transformer_config(cfg: GPTConfig, **overrides: Any) -> Any:
    """Megatron's ``TransformerConfig`` for ``cfg`` under the current tensor-parallel size."""
    import_megatron()
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer import TransformerConfig

    tp = mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    if cfg.num_attention_heads % tp or cfg.kv_heads % tp:
        raise ValueError(
            f"llm: {cfg.num_attention_heads} attention heads and {cfg.kv_heads} KV heads must both be divisible by "
            f"tensor_model_parallel_size={tp}."
        )
    attention_factor = rope_frequencies(cfg)[1]
    if attention_factor != 1.0:  # the rotated queries and keys both carry it: q.k scaled by its square
        overrides = {"softmax_scale": attention_factor**2 / math.sqrt(cfg.head_dim), **overrides}
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,  # the full weight is drawn on every rank, then sliced: TP=n == TP=1
        perform_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **overrides,
    )


def build_gpt(cfg: GPTConfig, **overrides: Any) -> torch.nn.Module:
    """Megatron's ``GPTModel`` for ``cfg``; the parallel state must be initialised (see :func:`ensure_parallel_state`).

    Weights are drawn from ``cfg.seed`` (with Megatron's CPU initialisation every TP rank draws the full weights and
    keeps its slice, so TP=2 starts from the same model as TP=1).
    """
    import_megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(cfg, **overrides)
    if _use_transformer_engine(cfg.transformer_engine):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm)
    state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = GPTModel(
            config,
            spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=int(cfg.rope_theta),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        )
    finally:
        torch.random.set_rng_state(state)
    if (cfg.rope_scaling or {}).get("rope_type", "default") != "default":
        model.rotary_pos_emb = _scaled_rotary_embedding()(cfg)
    return model


def gpt_logits(
    model: torch.nn.Module,
    *,
    input_ids: torch.Tensor | None = None,
    embeddings: torch.Tensor | None = None,
    inference_context: Any = None,
    position_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-vocabulary logits (B, T, V) from token ids or from input embeddings (B, T, D).

    ``embeddings`` bypass the model's embedding layer (how audio frames enter the LLM). Causal attention over the
    whole row: right padding never changes the logits of real positions. With ``inference_context`` (Megatron's
    ``StaticInferenceContext``) the call appends to its KV cache; positions start at ``position_offset``.
    ``attention_mask`` (B, 1, T, keys) bool, True where attention is *not* allowed, replaces the causal mask
    (batched generation with left padding). With ``labels`` (B, T; ids >= 0) the result is instead the per-token
    cross-entropy (B, T), computed on the vocabulary shards without gathering the logits.
    """
    if embeddings is None:
        embeddings = model.embedding.word_embeddings(input_ids)  # (B, T, D), TP all-reduced
    batch, length = embeddings.shape[:2]
    positions = torch.arange(position_offset, position_offset + length, device=embeddings.device)
    positions = positions.unsqueeze(0).expand(batch, length)
    # GPTModel wants (T, B, D) decoder input; ids are only used for their shape when decoder_input is given.
    dummy_ids = torch.zeros(batch, length, dtype=torch.long, device=embeddings.device)
    return model(
        dummy_ids,
        positions,
        attention_mask=attention_mask,
        decoder_input=embeddings.transpose(0, 1).contiguous(),
        inference_context=inference_context,
        labels=labels,
        runtime_gather_output=labels is None,
    )

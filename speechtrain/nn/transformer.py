"""Multi-head attention, feed-forward and a pre-norm transformer block, sharded over attention heads and the
feed-forward width under tensor parallelism. Tensors are batch-first: (B, T, D)."""

import contextlib
import math

import torch
import torch.nn.functional as F

from speechtrain.lightning import parallel_state
from speechtrain.nn.dropout import Dropout
from speechtrain.nn.parallel import ColumnParallelLinear, RowParallelLinear

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu}


def _model_parallel_rng():  # noqa: ANN202
    from speechtrain.lightning.megatron_compat import model_parallel_rng

    return model_parallel_rng()


def relative_positions(length: int, d_model: int, device: torch.device | None = None) -> torch.Tensor:
    """Sinusoidal encodings of the relative distances ``length - 1, ..., 0, ..., -(length - 1)``: (2T-1, D)."""
    distances = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)[:, None]  # (2T-1, 1)
    frequencies = torch.exp(torch.arange(0, d_model, 2, device=device) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(2 * length - 1, d_model, device=device)
    encoding[:, 0::2] = torch.sin(distances * frequencies)
    encoding[:, 1::2] = torch.cos(distances * frequencies)
    return encoding


def _relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """(B, h, T, 2T-1) scores against distances ``T-1 .. -(T-1)`` -> (B, h, T, T) scores of key j for query i.

    Query i's distance to key j, ``i - j``, sits in column ``T-1 - i + j``: row i of the result starts ``T-1 - i``
    columns in, which is a strided view (row stride ``2T-2``) of the contiguous scores: no copy, no padding.
    """
    batch, heads, time, positions = scores.shape
    scores = scores.contiguous()
    stride = scores.stride()
    return scores.as_strided(
        (batch, heads, time, time), (stride[0], stride[1], positions - 1, 1), scores.storage_offset() + time - 1
    )


class MultiHeadAttention(torch.nn.Module):
    """Scaled dot-product self-attention; each tensor-parallel rank owns ``num_heads / TP`` heads.

    With ``relative_positions`` it is Transformer-XL's attention (as in the Conformer): content and position
    terms with learned biases ``u`` and ``v`` per head, over sinusoidal encodings of relative distances.

    Args:
        d_model: model width.
        num_heads: attention heads (divisible by the TP size).
        dropout: dropout on attention probabilities (drawn from the model-parallel RNG stream under TP).
        relative_positions: add the relative-position terms.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, relative_positions: bool = False) -> None:
        super().__init__()
        tp = parallel_state.tensor_parallel_world_size()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}.")
        if num_heads % tp:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by tensor_model_parallel_size={tp}; choose a TP size "
                f"that divides the number of heads."
            )
        self.d_model = d_model
        self.local_heads = num_heads // tp
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        # Separate projections keep each rank's slice made of whole heads. A key bias would only add a constant
        # to each query's logits, which softmax ignores: its gradient is rounding noise that Adam would amplify.
        self.query = ColumnParallelLinear(d_model, d_model)
        self.key = ColumnParallelLinear(d_model, d_model, bias=False)
        self.value = ColumnParallelLinear(d_model, d_model)
        self.out = RowParallelLinear(d_model, d_model, input_is_parallel=True)
        self.relative_positions = relative_positions
        if relative_positions:
            self.position = ColumnParallelLinear(d_model, d_model, bias=False)
            # Zero-initialised, so identical in every layout; each rank holds its own heads' rows.
            self.pos_bias_u = torch.nn.Parameter(torch.zeros(self.local_heads, self.head_dim))
            self.pos_bias_v = torch.nn.Parameter(torch.zeros(self.local_heads, self.head_dim))
            if tp > 1:
                for bias in (self.pos_bias_u, self.pos_bias_v):
                    bias.tensor_model_parallel, bias.partition_dim, bias.partition_stride = True, 0, 1

    def _position_bias(self, q: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """(B, h, T, T) position scores ``(q + v) . p_(i-j)``, scaled, to add to the content scores. q: (B, h, T, d);
        positions: the (2T-1, D) encodings of :func:`relative_positions` (computed here when None)."""
        time = q.shape[2]
        if positions is None:
            positions = relative_positions(time, self.d_model, q.device)
        p = self.position(positions.to(q.dtype))  # (2T-1, h*d)
        p = p.view(2 * time - 1, self.local_heads, self.head_dim).permute(1, 2, 0)  # (2T-1, h, d) -> (h, d, 2T-1)
        scale = 1.0 / math.sqrt(self.head_dim)
        return _relative_shift(torch.matmul((q + self.pos_bias_v[:, None, :]) * scale, p))

    @staticmethod
    def _tp() -> int:
        return parallel_state.tensor_parallel_world_size()

    def forward(
        self,
        x: torch.Tensor,
        pad_mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: dict[str, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            x: (B, T, D) input (with ``cache``: the T newest positions).
            pad_mask: (B, T) bool, True on padded frames (they are never attended to).
            causal: position i attends to positions <= i only.
            cache: incremental decoding (causal, absolute positions only): the keys and values of earlier
                positions, read from and appended to this dict (``k``, ``v``: (B, h, T_past, d)).
            positions: relative-position attention: the (2T-1, D) :func:`relative_positions` encodings, computed once
                per forward by the caller for all its layers (computed here when None).

        Returns:
            (B, T, D), identical on all tensor-parallel ranks.
        """
        batch, time, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, time, self.local_heads, self.head_dim).transpose(1, 2)  # (B, T, h, d) -> (B, h, T, d)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        mask = None if pad_mask is None else ~pad_mask[:, None, None, :]  # (B, 1, 1, T): True = may attend
        if cache is not None:
            if self.relative_positions or not causal or pad_mask is not None:
                raise ValueError("A key/value cache needs causal attention without relative positions or padding.")
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        past = k.shape[2] - time
        if causal:
            keys = torch.arange(k.shape[2], device=x.device)
            allowed = keys[None, :] <= keys[past:, None]  # (T, T_past + T): query i sees keys up to past + i
            mask = allowed[None, None] if mask is None else mask & allowed[None, None]
        dropout = self.dropout if self.training else 0.0
        rng = _model_parallel_rng() if dropout > 0 and self._tp() > 1 else contextlib.nullcontext()
        with rng:
            if self.relative_positions:
                # The position term is an additive bias of the fused kernel, which adds the content term
                # (q + u) . k_j itself; padded keys get -inf in the same bias.
                bias = self._position_bias(q, positions)
                if mask is not None:
                    bias = bias.masked_fill(~mask, float("-inf"))
                q = q + self.pos_bias_u[:, None, :]
                mask = bias
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)  # (B, h, T, d)
        y = y.transpose(1, 2).reshape(batch, time, self.local_heads * self.head_dim)  # (B, h, T, d) -> (B, T, h*d)
        return self.out(y)


class CrossAttention(torch.nn.Module):
    """Multi-head attention of queries ``x`` over a ``memory`` (an encoder's output); each tensor-parallel rank owns
    ``num_heads / TP`` heads.

    An additive ``bias`` on the attention logits (e.g. the log of an alignment prior) steers where each query looks;
    the head-averaged attention probabilities can be returned (identical on all TP ranks) for alignment losses,
    images and monotonic decoding.

    Args:
        d_model: query and memory width.
        num_heads: attention heads (divisible by the TP size).
        dropout: dropout on attention probabilities.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        tp = parallel_state.tensor_parallel_world_size()
        if d_model % num_heads or num_heads % tp:
            raise ValueError(
                f"CrossAttention: d_model={d_model} must be divisible by num_heads={num_heads}, and num_heads by "
                f"tensor_model_parallel_size={tp}."
            )
        self.num_heads = num_heads
        self.local_heads = num_heads // tp
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.query = ColumnParallelLinear(d_model, d_model)
        self.key = ColumnParallelLinear(d_model, d_model, bias=False)
        self.value = ColumnParallelLinear(d_model, d_model)
        self.out = RowParallelLinear(d_model, d_model, input_is_parallel=True)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.local_heads, self.head_dim).transpose(1, 2)  # (B, h, T, d)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_pad_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over ``memory``.

        Args:
            x: (B, T, D) queries.
            memory: (B, S, D) keys and values.
            memory_pad_mask: (B, S) bool, True on padded memory positions.
            bias: added to the (B, h, T, S) attention logits; broadcastable, e.g. (B, 1, T, S).
            need_weights: also return the head-averaged attention probabilities (B, T, S).
            cache: incremental decoding: the memory's keys and values are projected once and kept here.

        Returns:
            (B, T, D) output and the (B, T, S) attention probabilities (or None).
        """
        q = self._heads(self.query(x))
        if cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self._heads(self.key(memory)), self._heads(self.value(memory))
            if cache is not None:
                cache["k"], cache["v"] = k, v
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(self.head_dim)  # (B, h, T, S)
        if bias is not None:
            scores = scores + bias
        if memory_pad_mask is not None:
            scores = scores.masked_fill(memory_pad_mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        dropout = self.dropout if self.training else 0.0
        if dropout > 0:
            rng = _model_parallel_rng() if self._tp() > 1 else contextlib.nullcontext()
            with rng:
                y = F.dropout(probs, dropout).to(v.dtype) @ v
        else:
            y = probs.to(v.dtype) @ v
        y = y.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.local_heads * self.head_dim)
        weights = None
        if need_weights:
            weights = probs.sum(dim=1)  # this rank's heads
            if self._tp() > 1:
                from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

                weights = reduce_from_tensor_model_parallel_region(weights)
            weights = weights / self.num_heads
        return self.out(y), weights

    @staticmethod
    def _tp() -> int:
        return parallel_state.tensor_parallel_world_size()


class FeedForward(torch.nn.Module):
    """``Linear(d, d_ff) -> activation -> dropout -> Linear(d_ff, d)``, the hidden width split over TP ranks."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"Unknown activation {activation!r}; choose one of {', '.join(_ACTIVATIONS)}.")
        self.up = ColumnParallelLinear(d_model, d_ff)
        self.down = RowParallelLinear(d_ff, d_model, input_is_parallel=True)
        self.activation = _ACTIVATIONS[activation]
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) -> (..., D)."""
        hidden = self.activation(self.up(x))
        if self.dropout.p > 0 and self.training and parallel_state.tensor_parallel_world_size() > 1:
            with _model_parallel_rng():
                hidden = self.dropout(hidden)
        else:
            hidden = self.dropout(hidden)
        return self.down(hidden)


class TransformerBlock(torch.nn.Module):
    """Pre-norm block: ``x + drop(MHA(LN(x)))``, then ``x + drop(FFN(LN(x)))``.

    Args:
        d_model: width.
        num_heads: attention heads.
        d_ff: feed-forward hidden width.
        dropout: residual and feed-forward dropout.
        attention_dropout: dropout on attention probabilities.
        activation: feed-forward activation.
        relative_positions: Transformer-XL relative-position attention.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        activation: str = "gelu",
        relative_positions: bool = False,
    ) -> None:
        super().__init__()
        self.attn_norm = torch.nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, num_heads, attention_dropout, relative_positions)
        self.ff_norm = torch.nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, d_ff, activation, dropout)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, D); pad_mask: (B, T) True on padding. Returns (B, T, D)."""
        x = x + self.dropout(self.attention(self.attn_norm(x), pad_mask))
        return x + self.dropout(self.feed_forward(self.ff_norm(x)))


class DecoderBlock(torch.nn.Module):
    """Pre-norm decoder block: causal self-attention, cross-attention over a memory, feed-forward, each residual.

    Args:
        d_model: width.
        num_heads: attention heads (self and cross).
        d_ff: feed-forward hidden width.
        dropout: residual and feed-forward dropout.
        attention_dropout: dropout on attention probabilities.
        activation: feed-forward activation.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        activation: str = "gelu",
    ) -> None:
        super().__init__()
        self.self_norm = torch.nn.LayerNorm(d_model)
        self.self_attention = MultiHeadAttention(d_model, num_heads, attention_dropout)
        self.cross_norm = torch.nn.LayerNorm(d_model)
        self.cross_attention = CrossAttention(d_model, num_heads, attention_dropout)
        self.ff_norm = torch.nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, d_ff, activation, dropout)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_pad_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (B, T, D) decoder input; memory: (B, S, D). ``cache`` (a dict, filled on first use) makes the call
        incremental: x holds only the newest positions. Returns (B, T, D) and the cross-attention weights (B, T, S)
        when ``need_weights``."""
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache.setdefault("self", {}), cache.setdefault("cross", {})
        x = x + self.dropout(self.self_attention(self.self_norm(x), causal=True, cache=self_cache))
        attended, weights = self.cross_attention(
            self.cross_norm(x), memory, memory_pad_mask, bias, need_weights, cross_cache
        )
        x = x + self.dropout(attended)
        return x + self.dropout(self.feed_forward(self.ff_norm(x))), weights

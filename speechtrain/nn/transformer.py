"""Multi-head attention, feed-forward and a pre-norm transformer block, sharded over attention heads and the
feed-forward width under tensor parallelism. Tensors are batch-first: (B, T, D)."""

import contextlib
import math

import torch
import torch.nn.functional as F

from speechtrain.lightning import parallel_state
from speechtrain.nn.dropout import Dropout
from speechtrain.nn.parallel import ColumnParallelLinear, RowParallelLinear, _PlainLinear

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu}


def _model_parallel_rng():  # noqa: ANN202
    from speechtrain.lightning.megatron_compat import model_parallel_rng

    return model_parallel_rng()


def relative_positions(length: int, d_model: int, device: torch.device | None = None, past: int = 0) -> torch.Tensor:
    """Sinusoidal encodings of the relative distances ``past + length - 1, ..., 0, ..., -(length - 1)``:
    (past + 2T-1, D); ``past``: keys before the T queries (a streaming cache), whose distances come first."""
    distances = torch.arange(past + length - 1, -length, -1, device=device, dtype=torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, d_model, 2, device=device) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(distances.shape[0], d_model, device=device)
    encoding[:, 0::2] = torch.sin(distances * frequencies)
    encoding[:, 1::2] = torch.cos(distances * frequencies)
    return encoding


def _relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """(..., T, K+T-1) scores against distances ``K-1 .. -(T-1)`` -> (..., T, K) scores of key j for query i, the
    queries being the last T of the K keys (K = T without a streaming cache).

    Query i's distance to key j, ``K-T + i - j``, sits in column ``T-1 - i + j``: row i of the result starts
    ``T-1 - i`` columns in, which is a strided view (row stride ``K+T-2``) of the contiguous scores: no copy, no
    padding.
    """
    *lead, time, positions = scores.shape
    scores = scores.contiguous()
    stride = scores.stride()
    keys = positions - time + 1
    return scores.as_strided((*lead, time, keys), (*stride[:-2], positions - 1, 1), scores.storage_offset() + time - 1)


def _fused_kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, dropout: float) -> bool:
    """Whether ``F.scaled_dot_product_attention`` runs a fused kernel on these inputs (a check on shapes, types and
    flags, no host synchronisation). The CPU's fused kernel takes no gradient for an additive bias; CUDA's
    memory-efficient one does, where the head size and type suit it."""
    if q.device.type == "cpu":
        return not (torch.is_grad_enabled() and bias.requires_grad)
    if q.device.type != "cuda":
        return True  # leave the choice to the device's own dispatcher
    params = torch.backends.cuda.SDPAParams(q, k, v, bias, dropout, False, False)
    cuda = torch.backends.cuda
    return any(can(params) for can in (cuda.can_use_flash_attention, cuda.can_use_efficient_attention,
                                       cuda.can_use_cudnn_attention))  # fmt: skip


def key_padding_bias(pad_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (B, S) bool ``pad_mask`` (True on padded keys) as the additive ``pad_mask`` that relative-position
    attention also takes: 0 on valid keys, ``dtype``'s lowest finite value (``dtype``: the attention logits') on
    padded ones. Made once per forward for all layers, it costs each layer one addition and its backward nothing,
    where a bool mask costs each layer a ``masked_fill`` copy forward and another backward."""
    return pad_mask.new_zeros(pad_mask.shape, dtype=dtype).masked_fill_(pad_mask, torch.finfo(dtype).min)


def logits_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of attention logits computed from ``x``: autocast's where it is on, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _attention_with_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    pad_mask: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with an additive (B, h, T, S) ``bias`` and padded keys, where no fused
    kernel takes them: its unfused path (the CPU's whenever the bias needs a gradient) dispatches about 60 operators
    forward and 130 backward, this one about a third of that (the scale folded into the product that adds the bias).

    q (B, h, T, d), k and v (B, h, S, d), pad_mask (B, S) True on padded keys (or additive:
    :func:`key_padding_bias`) -> (B, h, T, d). Padded keys get the
    lowest finite logit instead of -inf: their weight is still exactly 0 wherever a query has a valid key, and a
    query of an utterance with no valid frame gets finite values (which nothing reads) rather than NaN."""
    batch, heads, time, dim = q.shape
    keys = k.shape[2]
    if pad_mask is not None and pad_mask.is_floating_point():  # additive (:func:`key_padding_bias`)
        bias = bias + pad_mask[:, None, None, :]
    elif pad_mask is not None:
        bias = bias.masked_fill(pad_mask[:, None, None, :], torch.finfo(bias.dtype).min)
    bias = bias.expand(batch, heads, time, keys).reshape(batch * heads, time, keys)
    keys_t = k.reshape(batch * heads, keys, dim).transpose(1, 2)  # (B*h, d, S)
    scores = torch.baddbmm(bias, q.reshape(batch * heads, time, dim), keys_t, alpha=1.0 / math.sqrt(dim))
    probs = scores.softmax(-1)
    if dropout > 0:
        probs = F.dropout(probs, dropout)
    return torch.bmm(probs, v.reshape(batch * heads, keys, dim)).view(batch, heads, time, dim)


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
        """(B, h, T, K) position scores ``(q + v) . p_(i-j)``, scaled, to add to the content scores (a view). q:
        (B, T, h, d); positions: the (K+T-1, D) encodings of :func:`relative_positions` (computed here when None:
        K = T)."""
        batch, time = q.shape[:2]
        if positions is None:
            positions = relative_positions(time, self.d_model, q.device)
        p = self.position(positions.to(q.dtype))  # (P, h*d), P = K+T-1
        p = p.view(p.shape[0], self.local_heads, self.head_dim).permute(1, 2, 0)  # (P, h, d) -> (h, d, P)
        qv = (q + self.pos_bias_v).mul_(1.0 / math.sqrt(self.head_dim))  # (B, T, h, d)
        # One batched product per head over all B x T queries: (B, T, h, d) -> (h, B*T, d) is a view, where a
        # product of (B, h, T, d) with (h, d, 2T-1) would first copy p out to every utterance.
        scores = torch.bmm(qv.view(batch * time, self.local_heads, self.head_dim).transpose(0, 1), p)
        shifted = _relative_shift(scores.view(self.local_heads, batch, time, p.shape[2]))  # (h, B, T, K)
        return shifted.permute(1, 0, 2, 3)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, T, h, d) of x (B, T, D), this rank's heads. Without tensor parallelism (and without hooks on
        the three layers, e.g. adapters) as one matrix product with the three weights stacked: one kernel and its
        two backward products instead of three of each."""
        batch, time, _ = x.shape
        shape = (batch, time, self.local_heads, self.head_dim)
        layers = (self.query, self.key, self.value)
        linears = [layer.linear for layer in layers]
        if not all(isinstance(linear, _PlainLinear) for linear in linears) or any(
            m._forward_hooks or m._forward_pre_hooks for m in (*layers, *linears)
        ):
            return self.query(x).view(shape), self.key(x).view(shape), self.value(x).view(shape)
        weight = torch.cat([linear.weight for linear in linears])
        key_bias = self.key.linear.weight.new_zeros(()).expand(self.d_model)  # the key has no bias (see __init__)
        bias = torch.cat([self.query.linear.bias, key_bias, self.value.linear.bias])
        return F.linear(x, weight, bias).view(batch, time, 3, *shape[2:]).unbind(2)

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
        allowed: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            x: (B, T, D) input (with ``cache``: the T newest positions).
            pad_mask: (B, T) bool, True on padded frames (they are never attended to); with relative positions
                also the additive form of :func:`key_padding_bias`.
            causal: position i attends to positions <= i only.
            cache: incremental decoding (causal, absolute positions only): the keys and values of earlier
                positions, read from and appended to this dict (``k``, ``v``: (B, h, T_past, d)).
            positions: relative-position attention: the (2T-1, D) :func:`relative_positions` encodings, computed once
                per forward by the caller for all its layers (computed here when None); with ``memory`` of M frames,
                those of ``past=M``.
            allowed: bool, broadcastable to (B, h, T, K), True where query i may attend to key j (limited context);
                combined with ``pad_mask``. Every query must be allowed a key.
            memory: (B, M, D) inputs of M frames before ``x`` that are keys and values but not queries (a streaming
                cache; no ``pad_mask`` then); K = M + T keys.

        Returns:
            (B, T, D), identical on all tensor-parallel ranks.
        """
        batch, time, _ = x.shape
        if memory is None:
            q, k, v = self._projections(x)  # (B, T, h, d) each
        else:
            if pad_mask is not None:
                raise ValueError("Attention over a memory takes no pad_mask: mask with allowed.")
            q, k, v = self._projections(torch.cat([memory, x], dim=1))  # (B, K, h, d); the memory asks nothing
            q = q[:, memory.shape[1] :]
        if cache is not None:
            if self.relative_positions or not causal or pad_mask is not None:
                raise ValueError("A key/value cache needs causal attention without relative positions or padding.")
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, h, d) -> (B, h, T, d)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        rng = _model_parallel_rng() if dropout > 0 and self._tp() > 1 else contextlib.nullcontext()
        if self.relative_positions:
            # The position term is an additive bias of the fused kernel, which adds the content term (q + u) . k_j
            # itself; padded keys get -inf in the same bias.
            mask = self._position_bias(q, positions)
            if allowed is not None:
                mask = mask.masked_fill(~allowed, float("-inf"))
            q = q + self.pos_bias_u
        else:
            if pad_mask is not None and pad_mask.is_floating_point():
                raise ValueError("An additive pad_mask (key_padding_bias) is for relative-position attention only.")
            mask = None if pad_mask is None else ~pad_mask[:, None, None, :]  # (B, 1, 1, T): True = may attend
            if causal:
                past = k.shape[1] - time
                keys = torch.arange(k.shape[1], device=x.device)
                earlier = keys[None, :] <= keys[past:, None]  # (T, T_past + T): query i sees keys up to past + i
                mask = earlier[None, None] if mask is None else mask & earlier[None, None]
            if allowed is not None:
                mask = allowed if mask is None else mask & allowed
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, T, h, d) -> (B, h, T, d): views
        with rng:
            if self.relative_positions and not _fused_kernel_takes(q, k, v, mask, dropout):
                y = _attention_with_bias(q, k, v, mask, pad_mask, dropout)
            else:
                if self.relative_positions and pad_mask is not None and pad_mask.is_floating_point():
                    mask = mask + pad_mask[:, None, None, :]
                elif self.relative_positions and pad_mask is not None:
                    mask = mask.masked_fill(pad_mask[:, None, None, :], float("-inf"))
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

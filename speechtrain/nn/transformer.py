"""Multi-head attention, feed-forward and a pre-norm transformer block, sharded over attention heads and the
feed-forward width under tensor parallelism. Tensors are batch-first: (B, T, D)."""

import torch
import torch.nn.functional as F

from speechtrain.lightning import parallel_state
from speechtrain.nn.parallel import ColumnParallelLinear, RowParallelLinear

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu}


def _model_parallel_rng():  # noqa: ANN202
    from speechtrain.lightning.megatron_compat import model_parallel_rng

    return model_parallel_rng()


class MultiHeadAttention(torch.nn.Module):
    """Scaled dot-product self-attention; each tensor-parallel rank owns ``num_heads / TP`` heads.

    Args:
        d_model: model width.
        num_heads: attention heads (divisible by the TP size).
        dropout: dropout on attention probabilities (drawn from the model-parallel RNG stream under TP).
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        tp = parallel_state.tensor_parallel_world_size()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}.")
        if num_heads % tp:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by tensor_model_parallel_size={tp}; choose a TP size "
                f"that divides the number of heads."
            )
        self.local_heads = num_heads // tp
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        # Separate projections keep each rank's slice made of whole heads. A key bias would only add a constant
        # to each query's logits, which softmax ignores: its gradient is rounding noise that Adam would amplify.
        self.query = ColumnParallelLinear(d_model, d_model)
        self.key = ColumnParallelLinear(d_model, d_model, bias=False)
        self.value = ColumnParallelLinear(d_model, d_model)
        self.out = RowParallelLinear(d_model, d_model, input_is_parallel=True)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend.

        Args:
            x: (B, T, D) input.
            pad_mask: (B, T) bool, True on padded frames (they are never attended to).

        Returns:
            (B, T, D), identical on all tensor-parallel ranks.
        """
        batch, time, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, time, self.local_heads, self.head_dim).transpose(1, 2)  # (B, T, h, d) -> (B, h, T, d)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        mask = None if pad_mask is None else ~pad_mask[:, None, None, :]  # (B, 1, 1, T): True = may attend
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and parallel_state.tensor_parallel_world_size() > 1:
            with _model_parallel_rng():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(batch, time, self.local_heads * self.head_dim)  # (B, h, T, d) -> (B, T, h*d)
        return self.out(y)


class FeedForward(torch.nn.Module):
    """``Linear(d, d_ff) -> activation -> dropout -> Linear(d_ff, d)``, the hidden width split over TP ranks."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"Unknown activation {activation!r}; choose one of {', '.join(_ACTIVATIONS)}.")
        self.up = ColumnParallelLinear(d_model, d_ff)
        self.down = RowParallelLinear(d_ff, d_model, input_is_parallel=True)
        self.activation = _ACTIVATIONS[activation]
        self.dropout = torch.nn.Dropout(dropout)

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
        self.attn_norm = torch.nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, num_heads, attention_dropout)
        self.ff_norm = torch.nn.LayerNorm(d_model)
        self.feed_forward = FeedForward(d_model, d_ff, activation, dropout)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, D); pad_mask: (B, T) True on padding. Returns (B, T, D)."""
        x = x + self.dropout(self.attention(self.attn_norm(x), pad_mask))
        return x + self.dropout(self.feed_forward(self.ff_norm(x)))

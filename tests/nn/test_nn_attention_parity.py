"""The attention and masked batch norm with fewer dispatched operators compute what the earlier implementations did:
those are kept here as references (three separate projections, the broadcast position product, PyTorch's
``scaled_dot_product_attention`` on the biased scores; two-pass batch norm written out), compared in float64 (the
same arithmetic: within 1e-12) and float32 (within a few float32 roundings of the outputs' and gradients' scale:
the products sum in another order)."""

import math

import pytest
import torch
import torch.nn.functional as F

from speechtrain.asr.conformer import MaskedBatchNorm1d
from speechtrain.nn import MultiHeadAttention
from speechtrain.nn.transformer import (
    _fused_kernel_takes,
    _relative_shift,
    key_padding_bias,
    logits_dtype,
    relative_positions,
)


def _reference_attention(m: MultiHeadAttention, x, pad_mask, positions):
    """The relative-position attention as it was written before (one projection per input, sdpa with the bias)."""
    batch, time, _ = x.shape

    def heads(t):
        return t.view(batch, time, m.local_heads, m.head_dim).transpose(1, 2)  # (B, h, T, d)

    q, k, v = heads(m.query(x)), heads(m.key(x)), heads(m.value(x))
    p = m.position(positions).view(2 * time - 1, m.local_heads, m.head_dim).permute(1, 2, 0)
    bias = _relative_shift(torch.matmul((q + m.pos_bias_v[:, None, :]) / math.sqrt(m.head_dim), p))
    bias = bias.masked_fill(pad_mask[:, None, None, :], float("-inf"))
    y = F.scaled_dot_product_attention(q + m.pos_bias_u[:, None, :], k, v, attn_mask=bias)
    return m.out(y.transpose(1, 2).reshape(batch, time, -1))


def _reference_batch_norm(norm: MaskedBatchNorm1d, x, mask):
    valid = mask[:, None, :].to(x.dtype)
    count = valid.sum().clamp(min=1)
    mean = (x * valid).sum(dim=(0, 2)) / count
    var = (((x - mean[None, :, None]) * valid) ** 2).sum(dim=(0, 2)) / count
    x = (x - mean[None, :, None]) / torch.sqrt(var[None, :, None] + norm.eps)
    return x * norm.weight[None, :, None] + norm.bias[None, :, None]


def _outputs_and_gradients(module, run, inputs):
    inputs = [t.detach().requires_grad_() for t in inputs]
    module.zero_grad(set_to_none=True)
    out = run(*inputs)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)  # every output counts differently
    (out * weights).sum().backward()
    grads = [t.grad for t in inputs] + [p.grad for p in module.parameters() if p.grad is not None]
    return out.detach(), grads


def _assert_within(new, reference, tolerance):
    for a, b in zip(new, reference, strict=True):
        assert (a - b).abs().max() <= tolerance * b.abs().max().clamp(min=1e-30)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 3e-6)])
def test_relative_attention_equals_the_reference(dtype, tolerance):
    torch.manual_seed(0)
    m = MultiHeadAttention(48, 4, relative_positions=True).to(dtype).train()
    with torch.no_grad():  # learned biases away from their zero start
        m.pos_bias_u.normal_()
        m.pos_bias_v.normal_()
    x = torch.randn(3, 11, 48, dtype=dtype)
    pad_mask = torch.arange(11)[None, :] >= torch.tensor([11, 6, 1])[:, None]
    positions = relative_positions(11, 48).to(dtype)
    assert not _fused_kernel_takes(x[:, None], x[:, None], x[:, None], x.requires_grad_(), 0.0)  # the new path runs
    x = x.detach()
    new = _outputs_and_gradients(m, lambda x: m(x, pad_mask=pad_mask, positions=positions), [x])
    ref = _outputs_and_gradients(m, lambda x: _reference_attention(m, x, pad_mask, positions), [x])
    _assert_within([new[0], *new[1]], [ref[0], *ref[1]], tolerance)
    with torch.no_grad():  # without gradients the fused kernel takes the bias: the same numbers
        _assert_within([m(x, pad_mask=pad_mask, positions=positions)], [ref[0]], tolerance)


def test_a_query_with_no_valid_key_gets_finite_values_and_gradients():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 2, relative_positions=True).train()
    x = torch.randn(2, 5, 16, requires_grad=True)
    pad_mask = torch.arange(5)[None, :] >= torch.tensor([5, 0])[:, None]  # the second utterance has no frame
    out = m(x, pad_mask=pad_mask, positions=relative_positions(5, 16))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_masked_batch_norm_equals_the_reference(dtype, tolerance):
    torch.manual_seed(0)
    norm = MaskedBatchNorm1d(6).to(dtype).train()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 6, 9, dtype=dtype)
    mask = torch.arange(9)[None, :] < torch.tensor([9, 4, 7])[:, None]
    new = _outputs_and_gradients(norm, lambda x: norm(x, mask), [x])
    ref = _outputs_and_gradients(norm, lambda x: _reference_batch_norm(norm, x, mask), [x])
    _assert_within([new[0], *new[1]], [ref[0], *ref[1]], tolerance)


@pytest.mark.parametrize("fused", [False, True])
def test_an_additive_key_padding_bias_gives_the_bool_masks_numbers(fused):
    """The encoder's additive pad mask (made once for all layers) equals the bool one, outputs and gradients, on
    the lean path and (without gradients) on the fused kernel's. (An utterance with no valid frame differs in its
    gradients, which nothing downstream reads: its outputs are masked; it stays finite.)"""
    torch.manual_seed(0)
    m = MultiHeadAttention(24, 2, relative_positions=True).train()
    x = torch.randn(3, 7, 24)
    positions = relative_positions(7, 24)
    pad_mask = torch.arange(7)[None, :] >= torch.tensor([7, 3, 1])[:, None]
    additive = key_padding_bias(pad_mask, logits_dtype(x))
    if fused:
        with torch.no_grad():
            assert torch.equal(
                m(x, pad_mask=additive, positions=positions), m(x, pad_mask=pad_mask, positions=positions)
            )
        return
    new = _outputs_and_gradients(m, lambda x: m(x, pad_mask=additive, positions=positions), [x])
    ref = _outputs_and_gradients(m, lambda x: m(x, pad_mask=pad_mask, positions=positions), [x])
    for a, b in zip([new[0], *new[1]], [ref[0], *ref[1]], strict=True):
        assert torch.equal(a, b)
    empty = torch.arange(7)[None, :] >= torch.tensor([7, 3, 0])[:, None]
    out, grads = _outputs_and_gradients(
        m, lambda x: m(x, pad_mask=key_padding_bias(empty, x.dtype), positions=positions), [x]
    )
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="relative-position"):
        MultiHeadAttention(24, 2)(x, pad_mask=additive)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key_padding_bias(pad_mask, logits_dtype(x)).dtype == torch.bfloat16

"""The fast Conformer equals a frozen copy of the math it replaced (hand-written relative-position attention with
encodings rebuilt per layer, padding + view relative shift, mask-multiply-ReLU subsampling), outputs and gradients
within 1e-5 in fp32."""

import math

import pytest
import torch
import torch.nn.functional as F

from speechtrain.asr.conformer import ConformerConfig, ConformerEncoder


def _positions(length: int, d_model: int) -> torch.Tensor:
    distances = torch.arange(length - 1, -length, -1, dtype=torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(2 * length - 1, d_model)
    encoding[:, 0::2] = torch.sin(distances * frequencies)
    encoding[:, 1::2] = torch.cos(distances * frequencies)
    return encoding


def _shift(scores: torch.Tensor) -> torch.Tensor:
    batch, heads, time, positions = scores.shape
    scores = F.pad(scores, (1, 0))
    scores = scores.view(batch, heads, positions + 1, time)[:, :, 1:].view(batch, heads, time, positions)
    return scores[..., :time]


def _frames(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    return torch.arange(frames)[None, :] < lengths[:, None]


def _attention(att, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    batch, time, _ = x.shape
    h, d = att.local_heads, att.head_dim

    def heads(t):
        return t.view(batch, time, h, d).transpose(1, 2)

    q, k, v = heads(att.query(x)), heads(att.key(x)), heads(att.value(x))
    p = att.position(_positions(time, att.d_model)).view(2 * time - 1, h, d).transpose(0, 1)
    content = (q + att.pos_bias_u[None, :, None, :]) @ k.transpose(-1, -2)
    position = _shift((q + att.pos_bias_v[None, :, None, :]) @ p.transpose(-1, -2)[None])
    scores = ((content + position) / math.sqrt(d)).masked_fill(~mask[:, None, None, :], float("-inf"))
    y = scores.softmax(dim=-1) @ v
    return att.out(y.transpose(1, 2).reshape(batch, time, h * d))


def _conv_module(conv, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = F.glu(conv.pointwise_in(x), dim=-1)
    x = conv.depthwise((x * mask[:, :, None]).transpose(1, 2))
    x = conv.norm(x, mask) if conv.norm_type == "batch_norm" else conv.norm(x.transpose(1, 2)).transpose(1, 2)
    return conv.pointwise_out(F.silu(x).transpose(1, 2))


def _ff(ff, x: torch.Tensor) -> torch.Tensor:
    return ff.down(F.silu(ff.up(x)))


def reference_forward(encoder: ConformerEncoder, feats: torch.Tensor, lengths: torch.Tensor):
    """Today's encoder math, dropout off."""
    x = feats.transpose(1, 2).unsqueeze(1)
    for conv in encoder.subsampling.convs:
        x = x * _frames(lengths, x.shape[2])[:, None, :, None]
        x = F.relu(conv(x))
        lengths = torch.div(lengths - 1, 2, rounding_mode="floor") + 1
    x = x * _frames(lengths, x.shape[2])[:, None, :, None]
    batch, channels, frames, bands = x.shape
    x = encoder.subsampling.out(x.transpose(1, 2).reshape(batch, frames, channels * bands)) * encoder.xscale
    mask = _frames(lengths, x.shape[1])
    for layer in encoder.layers:
        x = x + 0.5 * _ff(layer.ff1, layer.ff1_norm(x))
        x = x + _attention(layer.attention, layer.attn_norm(x), mask)
        x = x + _conv_module(layer.conv, layer.conv_norm(x), mask)
        x = x + 0.5 * _ff(layer.ff2, layer.ff2_norm(x))
        x = layer.out_norm(x)
    return x * mask[:, :, None], lengths


@pytest.mark.parametrize(("subsampling", "factor", "norm"), [("dw_striding", 8, "batch_norm"),
                                                              ("striding", 4, "layer_norm")])  # fmt: skip
@pytest.mark.parametrize("training", [False, True])
def test_outputs_and_gradients_equal_the_reference(subsampling, factor, norm, training):
    torch.manual_seed(0)
    cfg = ConformerConfig(d_model=32, num_layers=2, num_heads=4, conv_kernel_size=5, subsampling=subsampling,
                          subsampling_factor=factor, subsampling_conv_channels=16, conv_norm_type=norm,
                          dropout=0.0, dropout_att=0.0, xscaling=True)  # fmt: skip
    encoder = ConformerEncoder(cfg, n_mels=20, seed=3)
    with torch.no_grad():
        for layer in encoder.layers:  # biases away from zero, so that their terms count
            layer.attention.pos_bias_u.normal_()
            layer.attention.pos_bias_v.normal_()
    encoder.train(training)
    feats, lengths = torch.randn(3, 20, 97), torch.tensor([97, 60, 21])
    outputs, grads = [], []
    for forward in (reference_forward, ConformerEncoder.forward):
        encoder.zero_grad()
        out, out_lengths = forward(encoder, feats, lengths)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append((out.detach(), out_lengths))
        grads.append({name: p.grad.clone() for name, p in encoder.named_parameters()})
    torch.testing.assert_close(outputs[1][0], outputs[0][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(outputs[1][1], outputs[0][1])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_activation_checkpointing_gives_the_same_outputs_and_gradients():
    cfg = ConformerConfig(d_model=32, num_layers=2, num_heads=4, conv_kernel_size=5, subsampling_conv_channels=16,
                          dropout=0.1, dropout_att=0.1)  # fmt: skip
    feats, lengths = torch.randn(3, 20, 97), torch.tensor([97, 60, 21])
    results = []
    for recompute in (False, True):
        encoder = ConformerEncoder(cfg, n_mels=20, seed=3).train()
        encoder.activation_checkpointing = recompute
        encoder.zero_grad()
        torch.manual_seed(7)  # the same dropout masks; the recomputation must redraw them identically
        out, _ = encoder(feats, lengths)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in encoder.parameters()]))
        results[-1][1].extend(b.clone() for b in encoder.buffers())  # batch norm counts each batch once
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    for with_recompute, without in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(with_recompute, without, atol=1e-6, rtol=1e-6)

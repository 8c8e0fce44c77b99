import pytest
import torch

from speechtrain.nn import MultiHeadAttention, TransformerBlock
from speechtrain.nn.transformer import _relative_shift, relative_positions


@pytest.mark.parametrize("relative", [False, True])
def test_padded_batch_equals_each_utterance_alone(relative):
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, 32, relative_positions=relative).eval()
    lengths = [7, 4, 2]
    xs = [torch.randn(n, 16) for n in lengths]
    batch = torch.zeros(3, 7, 16)
    for i, x in enumerate(xs):
        batch[i, : len(x)] = x
    pad_mask = torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]
    with torch.no_grad():
        out = block(batch, pad_mask)
        for i, x in enumerate(xs):
            torch.testing.assert_close(out[i, : len(x)], block(x[None])[0], atol=1e-5, rtol=1e-5)


def test_relative_shift_aligns_query_and_key_distances():
    time = 4
    distances = torch.arange(time - 1, -time, -1).float()  # what column c of the raw scores stands for
    raw = distances.expand(1, 1, time, 2 * time - 1)
    shifted = _relative_shift(raw)[0, 0]
    expected = torch.arange(time)[:, None] - torch.arange(time)[None, :]  # i - j
    assert torch.equal(shifted, expected.float())


def test_relative_encodings_and_head_checks():
    encoding = relative_positions(3, 8)
    assert encoding.shape == (5, 8)
    torch.testing.assert_close(encoding[2], torch.tensor([0.0, 1.0] * 4))  # distance 0
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MultiHeadAttention(10, 4)

import pytest
import torch

from speechtrain.nn.dropout import Dropout


def test_drop_rate_scale_gradient_and_eval_identity():
    torch.manual_seed(0)
    drop = Dropout(0.1)
    x = torch.ones(1001, 999, requires_grad=True)  # an odd count: the last 16-bit draw is half used
    y = drop(x)
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - 0.1) < 2e-3
    assert torch.allclose(y[kept], torch.tensor(1 / 0.9))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d(x * mask) / dx = mask, scale included
    assert drop.eval()(x) is x and Dropout(0.0)(x) is x
    with pytest.raises(ValueError, match="dropout"):
        Dropout(1.0)

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.asr.conformer import (
    ConformerConfig,
    ConformerEncoder,
    MaskedBatchNorm1d,
    TimeReduction,
    _depthwise_over_time,
)
from speechtrain.asr.spec_augment import SpecAugment, SpecAugmentConfig

JOB = Path(__file__).with_name("conformer_tp_job.py")


def _encoder(subsampling, factor, norm="batch_norm", unet=(-1, -1), layers=2):
    cfg = ConformerConfig(d_model=32, num_layers=layers, num_heads=4, conv_kernel_size=5, subsampling=subsampling,
                          subsampling_factor=factor, subsampling_conv_channels=16, conv_norm_type=norm,
                          dropout=0.0, dropout_att=0.0, time_reduce_idx=unet[0],
                          time_recovery_idx=unet[1])  # fmt: skip
    return ConformerEncoder(cfg, n_mels=20, seed=1)


@pytest.mark.parametrize(("subsampling", "factor"), [("striding", 4), ("dw_striding", 8), ("striding", 2)])
def test_output_shapes_and_lengths(subsampling, factor):
    encoder = _encoder(subsampling, factor).eval()
    lengths = torch.tensor([101, 64, 9, 1])
    out, out_lengths = encoder(torch.randn(4, 20, 101), lengths)
    expected = lengths.clone()
    for _ in range(factor.bit_length() - 1):
        expected = (expected - 1) // 2 + 1  # kernel 3, stride 2, padding 1
    assert out_lengths.tolist() == expected.tolist() and out.shape == (4, int(expected.max()), 32)
    assert expected.tolist()[0] == -(-101 // factor)
    assert torch.all(out[1, out_lengths[1] :] == 0)


@pytest.mark.parametrize(
    ("subsampling", "factor", "unet"),
    [("striding", 4, (-1, -1)), ("dw_striding", 8, (-1, -1)), ("striding", 4, (1, 2)), ("striding", 4, (0, 1))],
)
@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm"])
def test_padding_never_changes_valid_outputs(subsampling, factor, unet, norm):
    """Also with the temporal U-Net (layers on half the frames): ending inside the encoder or at its end."""
    torch.manual_seed(0)
    encoder = _encoder(subsampling, factor, norm, unet)
    encoder.train()
    encoder(torch.randn(4, 20, 80), torch.tensor([80, 70, 50, 20]))  # give batch norm some running statistics
    encoder.eval()
    lengths = [77, 40, 13]
    feats = [torch.randn(20, n) for n in lengths]
    batch = torch.zeros(3, 20, 77)
    for i, f in enumerate(feats):
        batch[i, :, : f.shape[1]] = f
    with torch.no_grad():
        out, out_lengths = encoder(batch, torch.tensor(lengths))
        for i, f in enumerate(feats):
            alone, n = encoder(f[None], torch.tensor([f.shape[1]]))
            assert int(n) == int(out_lengths[i])
            torch.testing.assert_close(out[i, : int(n)], alone[0], atol=1e-5, rtol=1e-5)


def test_temporal_unet_halves_the_middle_layers_frames_and_keeps_the_output_rate():
    """time_reduce_idx / time_recovery_idx: the layers between run on ceil(T / 2) frames, the output (and a captured
    layer's output, each half-rate frame twice) has the subsampling's frames; out-of-range indices are refused."""
    torch.manual_seed(0)
    encoder = _encoder("striding", 4, unet=(1, 3), layers=4).eval()
    seen = []
    for layer in encoder.layers:
        layer.register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    lengths = torch.tensor([101, 64])
    with torch.no_grad():
        out, out_lengths, (mid,) = encoder.forward_with_layers(torch.randn(2, 20, 101), lengths, (2,))
    assert seen == [26, 13, 13, 26] and out.shape[1] == mid.shape[1] == 26 and out_lengths.tolist() == [26, 16]
    assert torch.equal(mid[:, 0::2][:, :13], mid[:, 1::2][:, :13]) and torch.all(mid[1, 16:] == 0)
    for bad in ((2, 2), (3, 5), (-1, 2)):
        with pytest.raises(ValueError, match="time_reduce_idx"):
            _encoder("striding", 4, unet=bad, layers=4)


def test_time_reduction_runs_in_fp32_under_cpu_bf16_autocast():
    """The stride-2 depthwise convolution of the time reduction stays fp32 under CPU bf16 autocast (oneDNN's bf16
    backward of it takes a slow path): its output and its gradients equal the fp32 module's, not bf16's rounding."""
    torch.manual_seed(0)
    module = TimeReduction(16)
    x = torch.randn(3, 11, 16)
    mask = torch.arange(11)[None, :] < torch.tensor([11, 7, 4])[:, None]
    reference = module.depthwise(x.transpose(1, 2) * mask[:, None])  # plain Conv1d, fp32
    x_auto = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _depthwise_over_time(module.depthwise, x_auto, mask)
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=1e-6)
    out.square().sum().backward()
    x_ref = x.clone().requires_grad_()
    module.depthwise(x_ref.transpose(1, 2) * mask[:, None]).square().sum().backward()
    assert torch.allclose(x_auto.grad, x_ref.grad, atol=1e-5)


def test_masked_batch_norm_uses_valid_frames_only():
    norm = MaskedBatchNorm1d(2)
    x = torch.tensor([[[1.0, 3.0, 100.0]], [[5.0, 7.0, -50.0]]]).expand(2, 2, 3).clone()
    mask = torch.tensor([[True, True, False], [True, True, False]])
    y = norm(x, mask)
    valid = y[:, :, :2]
    torch.testing.assert_close(valid.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(norm.running_mean, torch.full((2,), 0.4))  # 0.1 * mean 4


def test_spec_augment_masks_inside_each_utterance_and_is_off_in_eval():
    torch.manual_seed(0)
    augment = SpecAugment(SpecAugmentConfig(freq_masks=2, freq_width=5, time_masks=4, time_width=0.1))
    feats = torch.ones(8, 20, 100)
    lengths = torch.tensor([100, 80, 60, 50, 40, 30, 20, 10])
    feats = feats * (torch.arange(100)[None, None, :] < lengths[:, None, None])
    out = augment(feats, lengths)
    assert torch.all(out[feats == 0] == 0) and (out == 0).sum() > (feats == 0).sum()
    for i, n in enumerate(lengths.tolist()):
        masked_frames = (out[i, :, :n] == 0).all(dim=0).sum()
        assert masked_frames <= 4 * int(0.1 * n)  # time masks are at most 10% of each utterance
        masked_bands = (out[i, :, :n] == 0).all(dim=1).sum()
        assert masked_bands <= 2 * 5
    assert torch.equal(augment.eval()(feats, lengths), feats)
    fixed = SpecAugment(SpecAugmentConfig(freq_masks=0, time_masks=1, time_width=7)).train()
    dropped = (fixed(torch.ones(50, 4, 100), torch.full((50,), 100)) == 0).all(dim=1).sum(dim=1)
    assert dropped.max() <= 7 and dropped.max() > 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("subsampling", ["dw_striding", pytest.param("striding", marks=pytest.mark.slow)])
def test_tensor_parallel_encoder_equals_single_process(tmp_path, subsampling):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    single, parallel = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    commands = [
        [sys.executable, str(JOB), "--out", str(single), "--subsampling", subsampling],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         str(JOB), "--out", str(parallel), "--subsampling", subsampling],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    a, b = torch.load(single, weights_only=False), torch.load(parallel, weights_only=False)
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(b["weights"][name], a["weights"][name], atol=1e-7, rtol=1e-6, msg=name)  # same init
    assert torch.equal(a["lengths"], b["lengths"])
    torch.testing.assert_close(b["out"], a["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b["first"], a["first"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b["second"], a["second"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b["feat_grad"], a["feat_grad"], atol=1e-5, rtol=1e-5)
    for name, grad in a["grads"].items():
        # Relative to the gradient's norm: some are zero up to rounding (a bias followed by batch norm).
        assert (b["grads"][name] - grad).norm() <= 1e-4 * grad.norm() + 1e-3, name

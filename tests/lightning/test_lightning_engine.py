"""Megatron Core's engine under the bridge: collectives in the same order whatever the data (2 gloo ranks, one of
them with an empty or a text-only batch), fp16 loss scaling, norms and clipping, precision modes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.lightning import MegatronMixedPrecision, MegatronOptimizer, MegatronParallel, teardown
from speechtrain.speechlm.backbone import ensure_parallel_state
from speechtrain.testing.toy_models import ToyTransformerRegressor, toy_dataset

JOB = Path(__file__).with_name("engine_job.py")


@pytest.fixture(autouse=True)
def _release_the_process_group():
    """Runs here leave their process group and Megatron state behind on purpose (saving after fit); the next test
    module starts clean."""
    yield
    teardown(None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["empty", "text-only"])
def test_a_rank_with_an_empty_or_text_only_batch_finishes_the_step_with_the_reference_gradients(case, tmp_path):
    """Rank 1's batch is empty (every utterance skipped) or text-only (SALM: the perception parameters get no
    gradient there). Under NCCL a different collective order would hang or corrupt: here the step must finish
    within the timeout and the reduced gradients must equal one process running both batches."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               str(JOB), "--case", case, "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["loss"] == pytest.approx(report["reference_loss"], rel=1e-6)
    assert report["max_difference"] < 1e-6, report


def _engine(precision: str = "32-true"):
    ensure_parallel_state()
    model = ToyTransformerRegressor({"batch_size": 8})
    model.configure_model()
    MegatronMixedPrecision(precision).convert_module(model)
    engine = MegatronParallel(model, device=torch.device("cpu"))
    optimizer = MegatronOptimizer.build(engine, name="sgd", lr=0.1, momentum=0.0, precision=precision)
    frames, targets, lengths = toy_dataset(model.cfg).tensors
    return model, engine, optimizer, (frames[:8], targets[:8], lengths[:8])


def _step(engine, optimizer, batch):
    optimizer.mcore.zero_grad()  # (the strategy's zeroing; the wrapper's zero_grad is Lightning's no-op)
    engine.start_window()
    engine.run(batch, forward_only=False)


def test_fp16_overflow_skips_the_step_and_megatrons_scaler_backs_off_after_its_hysteresis():
    model, engine, optimizer, batch = _engine("16-mixed")
    assert float(optimizer.mcore.grad_scaler.scale) == 2.0**32
    for overflows in (1, 2):
        _step(engine, optimizer, batch)
        weights = [p.detach().clone() for p in model.parameters()]
        next(model.parameters()).main_grad[0] = float("inf")
        optimizer.step()
        assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
        assert float(optimizer.mcore.grad_scaler.scale) == (
            2.0**32 if overflows == 1 else 2.0**31
        )  # hysteresis 2, then halved
    _step(engine, optimizer, batch)
    optimizer.step()
    assert not torch.equal(weights[0], next(model.parameters()))


def test_gradient_norm_and_clipping_match_torch_in_one_process():
    model, engine, optimizer, batch = _engine()
    reference = ToyTransformerRegressor({"batch_size": 8})
    reference.configure_model()
    reference.load_state_dict(model.state_dict())
    loss_sum, frames = reference.loss_step(batch, reference.forward_step(batch))
    (loss_sum / frames).backward()
    expected = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.1)
    _step(engine, optimizer, batch)
    optimizer.clip_grad = 0.1
    norms = []
    optimizer.should_update = lambda norm: norms.append(norm) or True
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert norms == [pytest.approx(float(expected), rel=1e-5)]
    for before, after, ref in zip(weights, model.parameters(), reference.parameters()):  # SGD: w - lr * clipped g
        torch.testing.assert_close(after.detach(), before - 0.1 * ref.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_cpu_optimizers_run_torchs_fused_kernels_with_the_python_loops_numbers(name):
    """torch runs Adam/AdamW fused and SGD foreach only for CUDA tensors by default; on the CPU the bridge asks for
    them (the per-parameter Python loop cost the demo step 43 ms), also after a checkpoint load restores the
    groups' saved flags. Three steps give the for-loop reference's weights."""
    model, engine, _, batch = _engine()
    reference = ToyTransformerRegressor({"batch_size": 8})
    reference.configure_model()
    reference.load_state_dict(model.state_dict())
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    optimizer = MegatronOptimizer.build(engine, name=name, momentum=0.9, clip_grad=0.05, **kwargs)
    flag = "fused" if name == "adamw" else "foreach"
    assert all(group[flag] for group in optimizer.param_groups)
    loop_cls = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    extra = {"betas": (0.9, 0.98)} if name == "adamw" else {"momentum": 0.9}
    decay = [p for p in reference.parameters() if p.ndim > 1]  # Megatron's rule: no decay on biases and norms
    rest = [p for p in reference.parameters() if p.ndim <= 1]
    loop = loop_cls([{"params": decay}, {"params": rest, "weight_decay": 0.0}], foreach=False, **kwargs, **extra)
    for _ in range(3):
        _step(engine, optimizer, batch)
        optimizer.step()
        loop.zero_grad()
        loss_sum, frames = reference.loss_step(batch, reference.forward_step(batch))
        (loss_sum / frames).backward()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.05)
        loop.step()
    for ours, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group.update(fused=None, foreach=None)  # a checkpoint written before the bridge asked for the kernels
    optimizer.load_state_dict(state)
    assert all(group[flag] for group in optimizer.param_groups)


def test_a_non_finite_gradient_norm_is_refused_by_the_guard_without_an_update():
    model, engine, optimizer, batch = _engine()
    asked = []
    optimizer.should_update = lambda norm: asked.append(norm) or False
    _step(engine, optimizer, batch)
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert asked
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


def test_bf16_true_gives_fp32_main_parameters_and_keeps_front_ends_in_fp32():
    class FrontEnd(torch.nn.Linear):
        keep_fp32 = True

    module = torch.nn.Sequential(FrontEnd(2, 2), torch.nn.Linear(2, 2))
    MegatronMixedPrecision("bf16-true").convert_module(module)
    assert module[0].weight.dtype == torch.float32 and module[1].weight.dtype == torch.bfloat16
    model, engine, optimizer, batch = _engine("bf16-true")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert type(optimizer.mcore).__name__ == "Float16OptimizerWithFloat16Params"
    main = [p for group in optimizer.param_groups for p in group["params"]]
    assert main and {p.dtype for p in main} == {torch.float32}


def test_precision_names_and_fp8_refusals():
    assert MegatronMixedPrecision(32).precision == "32-true"
    assert MegatronMixedPrecision("bf16-mixed").autocast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Unsupported precision"):
        MegatronMixedPrecision("8-mixed")
    with pytest.raises(ImportError, match=r"transformer-engine.*speechtrain\[gpu\]"):
        MegatronMixedPrecision("bf16-mixed", fp8="hybrid")
    plugin = MegatronMixedPrecision("bf16-mixed")
    plugin.fp8 = "hybrid"  # as if transformer-engine were installed
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        plugin.check_model(torch.nn.Linear(2, 2))
    plugin.device_type = "cuda"
    with pytest.raises(RuntimeError, match="transformer-engine layers, and Linear has none"):
        plugin.check_model(torch.nn.Linear(2, 2))

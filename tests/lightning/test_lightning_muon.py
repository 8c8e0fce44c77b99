"""Muon for the hidden matrices, AdamW for the rest (``model.optim.name=muon``): torch's numbers, batched; shared
by two data-parallel ranks with one process's numbers; inside Megatron's optimizer (clipping, checkpoints)."""

import copy
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.lightning import MegatronMixedPrecision, MegatronOptimizer, MegatronParallel, teardown
from speechtrain.lightning.muon import GroupedMuon, MuonWithAdamW, muon_parameters, orthogonalize
from speechtrain.speechlm.backbone import ensure_parallel_state
from speechtrain.testing.toy_models import ToyTransformerRegressor, toy_dataset

JOB = Path(__file__).with_name("muon_job.py")


class MuonToy(ToyTransformerRegressor):
    MUON_ADAMW_MODULES = ("input_proj", "head")


@pytest.fixture(autouse=True)
def _release_the_process_group():
    yield
    teardown(None)


def test_batched_muon_gives_torchs_muon_numbers():
    """Three steps of :class:`GroupedMuon` (matrices of one shape orthogonalised together, tall ones transposed)
    against ``torch.optim.Muon`` one matrix at a time, with Moonshot's learning-rate scale."""
    shapes = [(12, 8), (8, 8), (8, 12), (8, 8), (12, 8), (16, 4)]
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grouped = GroupedMuon(ours, lr=0.02, weight_decay=0.1, momentum=0.95)
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        grouped.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_a_matrix_without_a_gradient_keeps_its_momentum_as_torchs_muon_does():
    shapes = [(8, 6), (8, 6), (8, 6)]
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grouped = GroupedMuon(ours, lr=0.02, weight_decay=0.1)
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            a.grad = None if (step == 1 and i == 1) else torch.randn(a.shape)
            b.grad = None if a.grad is None else a.grad.clone()
        grouped.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_stacked_momentum_keeps_torchs_state_layout_and_resumes_from_it():
    """The momenta of one shape live in one stacked tensor, but the state is torch's (a ``momentum_buffer`` per
    matrix): a state dict loaded into a fresh optimizer (new tensors) or a buffer replaced from outside continues
    as the uninterrupted run."""
    shapes = [(8, 6), (8, 6), (6, 8), (8, 6)]
    torch.manual_seed(0)
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    runs = []
    for resume in (None, "state_dict", "replace"):
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        muon = GroupedMuon(params, lr=0.02, weight_decay=0.1)
        for step, step_grads in enumerate(grads):
            if step == 2 and resume == "state_dict":
                saved = muon.state_dict()
                buffers = [saved["state"][i]["momentum_buffer"] for i in range(len(shapes))]
                assert [tuple(b.shape) for b in buffers] == shapes
                stream = io.BytesIO()
                torch.save(saved, stream)  # (the views of one stack: stored once)
                stream.seek(0)
                muon = GroupedMuon(params, lr=0.02, weight_decay=0.1)
                muon.load_state_dict(torch.load(stream))
            if step == 2 and resume == "replace":  # e.g. Lightning moving the state to a device
                for p in params:
                    muon.state[p]["momentum_buffer"] = muon.state[p]["momentum_buffer"].clone()
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            muon.step()
        runs.append([p.detach().clone() for p in params])
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)


def test_orthogonalize_makes_the_singular_values_about_one():
    x = torch.randn(3, 16, 32)
    singular = torch.linalg.svdvals(orthogonalize(x).float())
    assert singular.min() > 0.5 and singular.max() < 1.5  # the quintic's band (not exactly 1: by design)
    with pytest.raises(ValueError, match="2-D"):
        GroupedMuon([torch.nn.Parameter(torch.zeros(3, 3, 3))])


@pytest.mark.multiprocess
def test_two_ranks_share_the_iterations_and_get_one_processs_weights(tmp_path):
    out = tmp_path / "result.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               str(JOB), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["moved"] > 0.01
    assert report["ranks_differ_by"] == 0.0
    assert report["differs_from_one_process_by"] == 0.0


def _engine(precision: str = "32-true", model_class=MuonToy):
    ensure_parallel_state()
    model = model_class({"batch_size": 8})
    model.configure_model()
    MegatronMixedPrecision(precision).convert_module(model)
    engine = MegatronParallel(model, device=torch.device("cpu"))
    frames, targets, lengths = toy_dataset(model.cfg).tensors
    return model, engine, (frames[:8], targets[:8], lengths[:8])


def _step(engine, optimizer, batch):
    optimizer.mcore.zero_grad()
    engine.start_window()
    engine.run(batch, forward_only=False)


def test_megatrons_optimizer_runs_muon_on_the_hidden_matrices_and_adamw_on_the_rest():
    """Inside Megatron's optimizer (global-norm clipping included), three steps give the weights of torch's Muon on
    the blocks' matrices and torch's AdamW on everything else (the input and output layers the model names, biases,
    norms: no weight decay on 1-D ones, Megatron's rule); its state survives a save and load."""
    model, engine, batch = _engine()
    reference = MuonToy({"batch_size": 8})
    reference.configure_model()
    reference.load_state_dict(model.state_dict())
    optimizer = MegatronOptimizer.build(engine, name="muon", lr=1e-2, weight_decay=0.1, clip_grad=0.05)
    inner = optimizer.mcore.optimizer
    assert isinstance(inner, MuonWithAdamW)
    chosen = muon_parameters(reference, reference.MUON_ADAMW_MODULES)
    names = {n for n, p in reference.named_parameters() if id(p) in chosen}
    assert names and all(n.startswith("blocks.") and n.endswith(".weight") for n in names)
    assert sum(len(g["params"]) for g in inner.muon.param_groups) == len(names)
    assert all(group["fused"] for group in inner.adamw.param_groups)  # CPU: torch's fused AdamW kernel
    matrices = [p for p in reference.parameters() if id(p) in chosen]
    decay = [p for p in reference.parameters() if id(p) not in chosen and p.ndim > 1]
    rest = [p for p in reference.parameters() if p.ndim <= 1]
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2,
                              weight_decay=0.1, betas=(0.9, 0.98))  # fmt: skip
    for step in range(3):
        _step(engine, optimizer, batch)
        optimizer.step()
        reference.zero_grad()
        loss_sum, frames = reference.loss_step(batch, reference.forward_step(batch))
        (loss_sum / frames).backward()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.05)
        muon.step()
        adamw.step()
        # Megatron sums the gradients in another order: after the first step, a last-bit difference may round an
        # element of the bf16 Newton-Schulz iterations the other way (~1e-4 in a weight; the steps are ~1e-2).
        for ours, ref in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=1e-6 if step == 0 else 2e-3)
    state = copy.deepcopy(optimizer.state_dict())  # (torch's state_dict holds the live tensors)
    momentum = [s["momentum_buffer"].clone() for s in inner.muon.state.values()]
    for s in inner.muon.state.values():
        s["momentum_buffer"].zero_()
    optimizer.load_state_dict(state)
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in zip(momentum, inner.muon.state.values()))
    assert all(group["fused"] for group in inner.adamw.param_groups)
    some_matrix, some_bias = inner.muon.param_groups[0]["params"][0], inner.adamw.param_groups[-1]["params"][0]
    for param in (some_matrix, some_bias):  # Lightning moves states to the device by writing them back
        optimizer.state[param] = {k: v.clone() for k, v in optimizer.state[param].items()}
    assert some_matrix in inner.muon.state and some_bias in inner.adamw.state and some_bias not in inner.muon.state
    assert len(optimizer.state) == sum(len(g["params"]) for g in optimizer.param_groups)
    with pytest.raises(ValueError, match="not this model's Muon"):
        inner.load_state_dict({"state": {}, "param_groups": []})


def test_bf16_true_runs_muon_on_the_fp32_main_copies():
    model, engine, batch = _engine("bf16-true")
    optimizer = MegatronOptimizer.build(engine, name="muon", lr=1e-2, precision="bf16-true")
    inner = optimizer.mcore.optimizer
    matrices = [p for g in inner.muon.param_groups for p in g["params"]]
    assert len(matrices) == len(muon_parameters(model, model.MUON_ADAMW_MODULES))
    assert all(p.dtype == torch.float32 for p in matrices)
    before = [p.detach().clone() for p in model.parameters()]
    frames, targets, lengths = batch
    _step(engine, optimizer, (frames.bfloat16(), targets.bfloat16(), lengths))
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.ndim == 2)


def test_muon_is_refused_by_name_where_it_cannot_run():
    _, engine, _ = _engine(model_class=ToyTransformerRegressor)
    with pytest.raises(ValueError, match="MUON_ADAMW_MODULES"):
        MegatronOptimizer.build(engine, name="muon")
    engine.use_distributed_optimizer = True
    engine.module.MUON_ADAMW_MODULES = ()
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        MegatronOptimizer.build(engine, name="muon")


def test_muon_settings_are_checked_by_key_before_any_run_folder():
    from speechtrain.common.config import ConfigError
    from speechtrain.core.model import check_optim_config

    check_optim_config({"name": "muon", "muon_momentum": 0.9, "ns_steps": 3})
    with pytest.raises(ConfigError, match=r"model.optim.ns_steps=0: must be between 1 and 99"):
        check_optim_config({"name": "muon", "ns_steps": 0})
    with pytest.raises(ConfigError, match=r"model.optim.name=lion: must be one of adamw, adam, sgd, muon"):
        check_optim_config({"name": "lion"})

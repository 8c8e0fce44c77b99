import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.lightning.launch import fresh_launch_env
from speechtrain.speechlm.backbone import GPTConfig, build_gpt, ensure_parallel_state, gpt_logits, transformer_config
from speechtrain.speechlm.lora import (
    FrozenEvalMixin,
    LoRAConfig,
    add_lora,
    apply_lora,
    freeze_all_but_lora,
    freeze_parameters,
    lora_modules,
    lora_state_dict,
    merge_lora,
    set_frozen_modules_eval,
    shard_tensor,
    train_keeping_frozen_eval,
    trainable_parameters,
    unshard_tensor,
)

JOB = Path(__file__).with_name("lora_tp_job.py")
TINY = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=64, transformer_engine=False)  # fmt: skip
LAYER0 = [
    "llm.decoder.layers.0.self_attention.linear_proj.lora_a",
    "llm.decoder.layers.0.self_attention.linear_proj.lora_b",
    "llm.decoder.layers.0.self_attention.linear_qkv.lora_a",
    "llm.decoder.layers.0.self_attention.linear_qkv.lora_b",
    "llm.decoder.layers.0.mlp.linear_fc1.lora_a",
    "llm.decoder.layers.0.mlp.linear_fc1.lora_b",
    "llm.decoder.layers.0.mlp.linear_fc2.lora_a",
    "llm.decoder.layers.0.mlp.linear_fc2.lora_b",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parallel_linears():
    ensure_parallel_state()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = transformer_config(TINY)
    init = torch.nn.init.normal_
    column = ColumnParallelLinear(6, 10, config=config, init_method=init, bias=True, gather_output=False,
                                  skip_bias_add=True)  # fmt: skip
    row = RowParallelLinear(10, 6, config=config, init_method=init, bias=False, input_is_parallel=True,
                            skip_bias_add=True)  # fmt: skip
    return column, row


class _SpeechLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.perception = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Dropout(0.1))
        self.llm = build_gpt(TINY)


def _speechlm():
    ensure_parallel_state()
    return _SpeechLM()


@pytest.mark.parametrize("kind", ["column", "row"])
def test_lora_zero_b_is_identity_and_scaling_matches_hand_computation(kind):
    column, row = _parallel_linears()
    layer = column if kind == "column" else row
    x = torch.randn(7, 3, layer.input_size)
    base_out, base_bias = layer(x)
    cfg = LoRAConfig(rank=3, alpha=12, seed=4)
    add_lora(layer, cfg, name=kind)
    assert layer.lora_a.shape == (3, layer.input_size) and layer.lora_b.shape == (layer.output_size, 3)
    assert not torch.equal(layer.lora_a, torch.zeros_like(layer.lora_a)) and not layer.lora_b.any()
    out, bias = layer(x)
    assert torch.equal(out, base_out) and (bias is base_bias)  # B = 0: the base layer exactly, same tuple
    with torch.no_grad():
        layer.lora_b.normal_(generator=torch.Generator().manual_seed(2))
    out, bias = layer(x)
    assert not torch.allclose(out, base_out)
    expected = base_out + 4.0 * (x @ layer.lora_a.T @ layer.lora_b.T)  # alpha / rank = 4
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert bias is base_bias
    # Gradients reach the adapters and the input, not only the base weight.
    x.requires_grad_()
    layer(x)[0].square().sum().backward()
    assert layer.lora_a.grad is not None and layer.lora_b.grad is not None and x.grad is not None
    # Merging folds the adapter into the weight and leaves the base module as it was built.
    merged = merge_lora(torch.nn.ModuleDict({"layer": layer}))
    assert merged == ["layer"] and not hasattr(layer, "lora_a") and not layer._forward_hooks
    torch.testing.assert_close(layer(x.detach())[0], expected, atol=1e-5, rtol=1e-5)


def test_lora_init_is_seeded_per_module():
    column, _ = _parallel_linears()
    other, _ = _parallel_linears()
    add_lora(column, LoRAConfig(seed=1), name="a")
    add_lora(other, LoRAConfig(seed=1), name="a")
    assert torch.equal(column.lora_a, other.lora_a)
    third, _ = _parallel_linears()
    add_lora(third, LoRAConfig(seed=1), name="b")
    assert not torch.equal(column.lora_a, third.lora_a)
    bound = 1 / column.input_size**0.5  # nn.Linear's default: kaiming-uniform with a = sqrt(5)
    assert column.lora_a.abs().max() <= bound


def test_gpt_lora_parameter_sets_eval_modes_and_state_dict_keys():
    model = _speechlm()
    before = {name: value for name, value in model.state_dict().items()}
    ids = torch.randint(0, TINY.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    model.eval()
    logits = gpt_logits(model.llm, input_ids=ids)

    names = apply_lora(model, LoRAConfig(rank=4))
    assert names == [
        f"llm.decoder.layers.{i}.{part}"
        for i in range(2)
        for part in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
    ]
    torch.testing.assert_close(gpt_logits(model.llm, input_ids=ids), logits, atol=0, rtol=0)  # B = 0

    report = freeze_all_but_lora(model)
    lora_names = LAYER0 + [name.replace("layers.0", "layers.1") for name in LAYER0]
    perception = ["perception.0.weight", "perception.0.bias"]
    assert sorted(report.trainable) == sorted(perception + lora_names)
    assert [name for name, p in model.named_parameters() if p.requires_grad] == report.trainable
    assert trainable_parameters(model) == [p for p in model.parameters() if p.requires_grad]
    assert set(report.frozen) == {name for name in before if name.startswith("llm.") and "_extra_state" not in name}
    assert report.trainable_count == sum(p.numel() for p in trainable_parameters(model))
    assert report.frozen_count + report.trainable_count == sum(p.numel() for p in model.parameters())

    # Frozen modules in eval mode after train(); modules holding adapters (or perception) stay in training mode.
    train_keeping_frozen_eval(model)
    modes = dict((name, module.training) for name, module in model.named_modules())
    assert modes[""] and modes["perception"] and modes["perception.1"] and modes["llm"] and modes["llm.decoder"]
    assert modes["llm.decoder.layers.0.self_attention.linear_qkv"] and modes["llm.decoder.layers.1.mlp"]
    assert not modes["llm.embedding"] and not modes["llm.embedding.word_embeddings"]
    assert not modes["llm.decoder.final_layernorm"] and not modes["llm.output_layer"]
    assert not modes["llm.decoder.layers.0.input_layernorm"]
    assert modes["llm.decoder.layers.0.self_attention.core_attention"]  # no parameters, inside no frozen module

    # State-dict keys: the base keys unchanged (incl. Megatron's _extra_state), plus the adapters.
    after = model.state_dict()
    assert set(after) - set(before) == set(lora_names)
    assert set(lora_state_dict(model)) == set(lora_names)
    assert "llm.decoder.layers.0.self_attention.linear_qkv._extra_state" in after
    result = model.load_state_dict(before, strict=False)
    assert sorted(result.missing_keys) == sorted(lora_names) and not result.unexpected_keys

    # Training the adapters changes the output; merging them reproduces it without adapters.
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(gpt_logits(model.llm, input_ids=ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
    assert all(p.grad is None for p in model.llm.parameters() if not p.requires_grad)
    model.eval()
    tuned = gpt_logits(model.llm, input_ids=ids)
    assert not torch.allclose(tuned, logits)
    assert len(merge_lora(model)) == 8 and not lora_modules(model)
    assert set(model.state_dict()) == set(before)
    torch.testing.assert_close(gpt_logits(model.llm, input_ids=ids), tuned, atol=1e-5, rtol=1e-5)


def test_apply_lora_errors():
    model = _speechlm()
    with pytest.raises(ValueError, match="no module name ends with"):
        apply_lora(model, LoRAConfig(targets=["linear_qvk"]))
    with pytest.raises(TypeError, match="not a Megatron ColumnParallelLinear"):
        apply_lora(model, LoRAConfig(targets=["perception.0"]))
    apply_lora(model, LoRAConfig(targets=["self_attention.linear_qkv"]))
    assert list(lora_modules(model)) == [f"llm.decoder.layers.{i}.self_attention.linear_qkv" for i in range(2)]
    with pytest.raises(ValueError, match="already has an adapter"):
        apply_lora(model, LoRAConfig(targets=["linear_qkv"]))


def test_freeze_regex_with_exceptions_and_report():
    model = torch.nn.Module()
    model.perception = torch.nn.Module()
    model.perception.encoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model.perception.proj = torch.nn.Linear(4, 8)
    model.llm = torch.nn.Module()
    model.llm.embedding = torch.nn.Embedding(10, 8)
    model.llm.head = torch.nn.Linear(8, 10, bias=False)
    report = freeze_parameters(model, [r"perception\.encoder\.", r"^llm\."], [r"\.1\.", r"head"])
    assert report.frozen == ["perception.encoder.0.weight", "perception.encoder.0.bias", "llm.embedding.weight"]
    assert report.trainable == ["perception.encoder.1.weight", "perception.encoder.1.bias", "perception.proj.weight",
                                "perception.proj.bias", "llm.head.weight"]  # fmt: skip
    assert report.frozen_count == 16 + 4 + 80 and report.trainable_count == 4 + 4 + 32 + 8 + 80
    assert "trainable 128 of 228 parameters" in str(report)
    with pytest.raises(ValueError, match="match no parameter"):
        freeze_parameters(model, [r"encoder\."])  # re.match: anchored at the start of the name
    assert freeze_parameters(model, [r"encoder\."], strict=False).frozen == report.frozen
    # Fully frozen module in eval mode still passes gradients to its input.
    assert set_frozen_modules_eval(model.train()) == ["perception.encoder.0", "llm.embedding"]
    frozen = model.perception.encoder[0]
    assert not frozen.training and model.perception.encoder.training
    x = torch.randn(3, 4, requires_grad=True)
    model.perception.proj(model.perception.encoder(x)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and frozen.weight.grad is None
    assert model.perception.proj.weight.grad is not None


def test_frozen_eval_mixin():
    class Module(FrozenEvalMixin, torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
            self.head = torch.nn.Linear(2, 2)

    module = Module()
    freeze_parameters(module, [r"frozen\."])
    assert module.train() is module
    assert module.training and module.head.training and not module.frozen.training and not module.frozen[1].training
    module.eval()
    assert not module.head.training
    module.train()
    assert module.head.training and not module.frozen.training


def test_shard_and_unshard_follow_megatron_strides():
    full = torch.arange(24.0).reshape(8, 3)
    pieces = [shard_tensor(full, 0, rank, 2, stride=2) for rank in range(2)]
    assert torch.equal(pieces[0], full[[0, 1, 4, 5]]) and torch.equal(pieces[1], full[[2, 3, 6, 7]])  # [gate_r; up_r]
    assert torch.equal(unshard_tensor(pieces, 0, stride=2), full)
    pieces = [shard_tensor(full, 1, rank, 3) for rank in range(3)]
    assert torch.equal(unshard_tensor(pieces, 1), full)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_parallel_lora_equals_single_process(tmp_path):
    env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")  # not an earlier test's rendezvous
    single, parallel = tmp_path / "tp1.pt", tmp_path / "tp2.pt"
    commands = [
        [sys.executable, str(JOB), "--out", str(single)],
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         str(JOB), "--out", str(parallel)],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    a, b = torch.load(single, weights_only=False), torch.load(parallel, weights_only=False)
    assert a["names"] == b["names"] and len(a["names"]) == 8
    torch.testing.assert_close(b["logits"], a["logits"], atol=1e-5, rtol=1e-5)
    assert len(a["losses"]) == 4 and a["losses"][-1] < a["losses"][0]  # the adapters learn
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) < 1e-5
    assert sorted(a["grads"]) == sorted(b["grads"]) and all("lora_" in name for name in a["grads"])
    assert len(a["grads"]) == 16
    for name, grad in a["grads"].items():
        assert grad.norm() > 0, name  # B was set nonzero: A has a gradient too
        assert b["grads"][name].shape == grad.shape, name
        torch.testing.assert_close(b["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for name, weight in a["weights"].items():  # after 3 Adam steps, gathered
        torch.testing.assert_close(b["weights"][name], weight, atol=1e-5, rtol=1e-5, msg=name)

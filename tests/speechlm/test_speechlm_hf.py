"""Hugging Face Llama / Qwen2 / Qwen3 <-> Megatron GPT: logits parity at import (rotary scaling included), export
round trips, TP=2 (each rank reading its own shares), bad configs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from speechtrain.speechlm.backbone import GPTConfig, build_gpt, ensure_parallel_state, gpt_logits  # noqa: E402
from speechtrain.speechlm.hf import export_hf, gpt_config_from_hf, hf_config_dict, import_hf  # noqa: E402

JOB = Path(__file__).with_name("hf_tp_job.py")
CASES = [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True), ("qwen2", True), ("qwen3", True)]
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# Rotary scaling cases: (architecture, transformers' rope_parameters less rope_theta, max_position_embeddings).
# The long batch (40 positions) runs past original_max_position_embeddings (16), and for dynamic past the context.
ROPE_CASES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0}, 64),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}, 16),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}, 64),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),
    "yarn_mscale": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                              "truncate": False}, 64),
}  # fmt: skip


def _hf_model(arch: str, tied: bool, seed: int = 0, rope: dict | None = None, max_positions: int = 64):
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": 20000.0},
        **({"head_dim": 24} if arch == "qwen3" else {}),  # Qwen3: heads x head_dim (96) differs from hidden_size
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # every weight random (norms around one), so a swapped tensor cannot hide
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _save(model, folder: Path, sharded: bool = False) -> Path:
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB" if sharded else "5GB")
    return folder


def _hf_logits(folder_or_model, ids):
    model = folder_or_model
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(ids, attention_mask=torch.ones_like(ids)).logits


def _ids(vocab: int = 96, batch: int = 3, length: int = 11):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(5))


def _our_logits(model, ids):
    with torch.no_grad():
        return gpt_logits(model.eval(), input_ids=ids)


@pytest.fixture(scope="module", autouse=True)
def _parallel_state():
    ensure_parallel_state()


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_import_matches_hf_logits(tmp_path, arch, tied):
    hf = _hf_model(arch, tied)
    folder = _save(hf, tmp_path / "hf", sharded=tied)
    if tied:
        assert (folder / "model.safetensors.index.json").exists()
    model, cfg = import_hf(folder)
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.qkv_bias) == (arch, tied, arch == "qwen2")
    assert cfg.rope_theta == 20000.0 and cfg.kv_heads == 2 and cfg.norm_eps == 1e-6 and cfg.rope_scaling is None
    qwen3 = arch == "qwen3"
    assert (cfg.qk_layernorm, cfg.head_dim, cfg.kv_channels) == ((True, 24, 24) if qwen3 else (False, 16, None))
    ids = _ids()
    ours, theirs = _our_logits(model, ids), _hf_logits(hf, ids)
    print(f"TP=1 {arch} tied={tied}: max |logit diff| = {(ours - theirs).abs().max().item():.2e}")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("arch", "tied"), CASES[:4] + CASES[5:])
def test_export_round_trip(tmp_path, arch, tied):
    hf = _hf_model(arch, tied, seed=1)
    folder = _save(hf, tmp_path / "hf")
    model, cfg = import_hf(folder)
    export_hf(model, cfg, tmp_path / "out", tokenizer_dir=folder)
    assert (tmp_path / "out" / "generation_config.json").exists()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]]  # fmt: skip
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = _ids()
    torch.testing.assert_close(_hf_logits(exported, ids), _hf_logits(hf, ids), atol=1e-5, rtol=1e-5)
    for name, tensor in hf.state_dict().items():  # weights come back bit-exact
        assert torch.equal(exported.state_dict()[name], tensor), name
    again, cfg_again = import_hf(tmp_path / "out")
    assert cfg_again == cfg
    first = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    second = {k: v for k, v in again.state_dict().items() if isinstance(v, torch.Tensor)}
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_scaling_import_export_match_hf(tmp_path, case):
    """Logits equal to transformers' on a short batch and one past the original context; export loads in
    transformers with the same rotary parameters and logits; the config round-trips."""
    arch, rope, positions = ROPE_CASES[case]
    hf = _hf_model(arch, False, seed=3, rope=rope, max_positions=positions)
    folder = _save(hf, tmp_path / "hf")
    model, cfg = import_hf(folder)
    assert cfg.rope_scaling == rope and cfg.max_position_embeddings == positions
    short, long = _ids(), _ids(batch=2, length=40)
    for ids in (short, long):
        ours, theirs = _our_logits(model, ids), _hf_logits(hf, ids)
        print(f"{case} T={ids.shape[1]}: max |logit diff| = {(ours - theirs).abs().max().item():.2e}")
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    plain, _ = import_hf(folder, rope_scaling=None)  # the scaling is visible: plain RoPE gives other logits
    assert (_our_logits(plain, long) - theirs).abs().max() > 1e-2
    export_hf(model, cfg, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert exported.config.rope_parameters == {**rope, "rope_theta": 20000.0}
    torch.testing.assert_close(_hf_logits(exported, long), theirs, atol=1e-5, rtol=1e-5)
    assert gpt_config_from_hf(tmp_path / "out") == cfg


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_scaling_spellings(tmp_path, case):
    """transformers < 5 (rope_theta + rope_scaling, "type" in old files) and 5.x (rope_parameters) read alike."""
    arch, rope, positions = ROPE_CASES[case]
    config = {"model_type": arch, "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": positions}  # fmt: skip
    legacy = {k: v for k, v in rope.items() if k != "rope_type"} | {"type": rope["rope_type"]}
    spellings = [
        {"rope_parameters": {**rope, "rope_theta": 5e5}},  # 5.x
        {"rope_theta": 5e5, "rope_scaling": legacy},  # < 5
        {"rope_theta": 5e5, "rope_scaling": rope, "rope_parameters": {"rope_type": "default"}},  # both: 5.x reads
    ]
    cfgs = []
    for i, spelling in enumerate(spellings):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps({**config, **spelling}))
        cfgs.append(gpt_config_from_hf(tmp_path / str(i)))
    assert cfgs[0] == cfgs[1] == cfgs[2] and cfgs[0].rope_theta == 5e5 and cfgs[0].rope_scaling == rope


def test_rope_defaults_filled_in_as_transformers_does(tmp_path):
    """llama3 / yarn without original_max_position_embeddings: the context; yarn without factor: the stretch."""
    folder = _write_config(tmp_path, max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 16, "factor": None})  # fmt: skip
    assert gpt_config_from_hf(folder).rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 16}  # fmt: skip
    folder = _write_config(tmp_path, max_position_embeddings=64, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})  # fmt: skip
    assert gpt_config_from_hf(folder).rope_scaling["original_max_position_embeddings"] == 64


def _write_config(tmp_path, **changes):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128).to_dict()  # fmt: skip
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "'longrope'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs .'low_freq_factor', 'high_freq_factor'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "finetuned": 1}}, "keys .'finetuned'"),
        ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, r"rope_parameters keys \['factor'\]"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_unsupported_config_raises(tmp_path, changes, field):
    with pytest.raises(ValueError, match=field) as error:
        gpt_config_from_hf(_write_config(tmp_path, **changes))
    assert str(tmp_path / "config.json") in str(error.value)


def test_export_and_backbone_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="only 'qwen3' has q/k norms"):
        hf_config_dict(GPTConfig(architecture="llama", qk_layernorm=True))
    with pytest.raises(ValueError, match="only 'qwen3' has q/k norms"):
        hf_config_dict(GPTConfig(architecture="qwen3"))
    with pytest.raises(ValueError, match="only 'qwen2' has q/k/v biases"):
        hf_config_dict(GPTConfig(architecture="qwen3", qk_layernorm=True, qkv_bias=True))
    with pytest.raises(ValueError, match="llm.rope_scaling: rope_type='longrope'"):
        build_gpt(GPTConfig(num_layers=1, rope_scaling={"rope_type": "longrope"}))
    with pytest.raises(ValueError, match=r"rope_type='yarn' needs \['original_max_position_embeddings'\]"):
        build_gpt(GPTConfig(num_layers=1, rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_legacy_rope_theta_and_overrides(tmp_path):
    folder = _write_config(tmp_path, rope_parameters=None, rope_theta=1e6, rope_scaling=None)
    cfg = gpt_config_from_hf(folder, seed=3)
    assert cfg.rope_theta == 1e6 and cfg.seed == 3 and cfg.kv_heads == 2 and cfg.head_dim == 16
    assert cfg.kv_channels is None and cfg.rope_scaling is None
    cfg = gpt_config_from_hf(_write_config(tmp_path, head_dim=32))  # Llama's own head width: 4 x 32 != 64
    assert cfg.kv_channels == 32 and cfg.head_dim == 32
    folder = _write_config(tmp_path, model_type="qwen3", head_dim=None)  # Qwen3's default head width
    assert gpt_config_from_hf(folder).head_dim == 128


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _save(_hf_model("llama", False), tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.extra.weight"):
        import_hf(folder)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        import_hf(folder)


def test_vocab_not_divisible_by_tp_raises(tmp_path, monkeypatch):
    from speechtrain.lightning import parallel_state

    monkeypatch.setattr(parallel_state, "tensor_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="vocab_size=97"):
        import_hf(_write_config(tmp_path, vocab_size=97))


# Megatron's TP layout of each split tensor: (dimension, stride); see speechtrain.lightning.checkpoint.
_SPLIT = {"word_embeddings.weight": (0, 1), "output_layer.weight": (0, 1), "linear_qkv.weight": (0, 1),
          "linear_proj.weight": (1, 1), "linear_fc1.weight": (0, 2), "linear_fc2.weight": (1, 1)}  # fmt: skip


def test_tensor_parallel_rank_reads_only_its_shares(tmp_path, monkeypatch):
    """Each TP rank's tensors are Megatron's slices of the full ones, and the rank reads from the safetensors no
    more elements than it keeps (split tensors come as slices, never whole)."""
    import safetensors

    from speechtrain.speechlm.hf import _CheckpointReader, _hf_to_megatron

    folder = _save(_hf_model("qwen3", False), tmp_path / "hf", sharded=True)
    cfg = gpt_config_from_hf(folder)
    norms = ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    read = []
    real_open = safetensors.safe_open

    class CountingSlice:
        def __init__(self, part):
            self.part = part

        def get_shape(self):
            return self.part.get_shape()

        def __getitem__(self, index):
            read.append(self.part[index].numel())
            return self.part[index]

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return CountingSlice(self.file.get_slice(name))

    monkeypatch.setattr(safetensors, "safe_open", CountingOpen)
    with _CheckpointReader(folder, 0, 1) as reader:
        full = _hf_to_megatron(reader.take, cfg, norms, 1)
    assert not reader.unused and sum(read) == sum(t.numel() for t in full.values())
    for rank in range(2):
        read.clear()
        with _CheckpointReader(folder, rank, 2) as reader:
            shard = _hf_to_megatron(reader.take, cfg, norms, 2)
        assert shard.keys() == full.keys() and not reader.unused
        for name, tensor in full.items():
            dim, stride = next((v for k, v in _SPLIT.items() if name.endswith(k)), (None, 1))
            if dim is not None:
                tensor = torch.cat([part.chunk(2, dim)[rank] for part in tensor.chunk(stride, dim)], dim)
            assert torch.equal(shard[name], tensor), name
        assert sum(read) == sum(t.numel() for t in shard.values()) < 0.6 * sum(t.numel() for t in full.values())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
def test_tensor_parallel_import_and_export(tmp_path):
    """TP=2 (one launch, three models): Qwen2 with untied output layer and QKV biases, tied Llama, Qwen3 (q/k norms,
    its own head width) with YaRN scaling."""
    cases = [("qwen2", False, None), ("llama", True, None), ("qwen3", False, ROPE_CASES["yarn"][1])]
    models = [_hf_model(arch, tied, seed=2, rope=rope) for arch, tied, rope in cases]
    folders = [_save(hf, tmp_path / f"hf{i}") for i, hf in enumerate(models)]
    ids = _ids(batch=2, length=24)
    torch.save(ids, tmp_path / "ids.pt")
    out = tmp_path / "tp2"
    out.mkdir()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               str(JOB), "--hf", *map(str, folders), "--ids", str(tmp_path / "ids.pt"), "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for i, ((arch, tied, _), hf) in enumerate(zip(cases, models)):
        theirs = _hf_logits(hf, ids)
        ours = torch.load(out / f"{i}.pt")
        print(f"TP=2 {arch} tied={tied}: max |logit diff| = {(ours - theirs).abs().max().item():.2e}")
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        exported = transformers.AutoModelForCausalLM.from_pretrained(out / f"{i}.hf", attn_implementation="eager")
        for name, tensor in hf.state_dict().items():
            assert torch.equal(exported.state_dict()[name], tensor), name
        torch.testing.assert_close(_hf_logits(exported, ids), theirs, atol=1e-5, rtol=1e-5)

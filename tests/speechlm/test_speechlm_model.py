"""SALM model: batches, loss, KV-cache generation, freezing/LoRA, archives, JSONL conversations, the example script
and TP=2 training equal to TP=1."""

import csv
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speechtrain.lightning.launch import fresh_launch_env
from speechtrain.speechlm.backbone import ensure_parallel_state
from speechtrain.speechlm.prompts import get_template
from speechtrain.speechlm.tokenizer import train_bpe_tokenizer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TEXTS = ["1 2 3 4 5 6 7 8 9 0", "Transcribe the audio.", "What is the last digit?", "0 9 8 7 6 5 4 3 2 1"] * 20


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llm_tokenizer")
    train_bpe_tokenizer(TEXTS, 300, get_template("llama3").special_tokens).save(folder)
    return folder / "tokenizer.json"


def tiny_salm_config(tokenizer_file, manifest=None, **overrides):
    cfg = {
        "prompt_format": "llama3",
        "tasks": [{"name": "transcribe", "instruction": "Transcribe the audio.", "answer": "transcript",
                   "weight": 2.0},
                  {"name": "last_word", "instruction": "What is the last digit?", "answer": "last_word"}],
        "perception": {
            "preprocessor": {"n_mels": 16, "dither": 0.0},
            "encoder": {"d_model": 16, "num_layers": 1, "num_heads": 2, "conv_kernel_size": 3,
                        "subsampling": "striding", "subsampling_factor": 4, "subsampling_conv_channels": 8,
                        "dropout": 0.0, "dropout_att": 0.0},
            "adapter": {"subsampling": 2, "num_layers": 1},
        },
        "llm": {"config": {"vocab_size": 320, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4,
                           "num_query_groups": 2, "ffn_hidden_size": 64, "max_position_embeddings": 512},
                "tokenizer": str(tokenizer_file)},
        "freeze": [],
        "generation": {"max_new_tokens": 12},
        "train_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_duration": None,
                     "batch_tokens": 600, "num_buckets": 2, "shuffle": True},
        "validation_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 8,
                          "use_bucketing": False, "shuffle": False},
        "optim": {"lr": 3e-3, "sched": {"name": "constant", "warmup_steps": 2}},
    }  # fmt: skip
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def tiny_salm(tokenizer_file, manifest=None, seed=0, **overrides):
    from speechtrain.speechlm.model import SALMModel

    ensure_parallel_state()
    torch.manual_seed(seed)
    model = SALMModel(tiny_salm_config(tokenizer_file, manifest, **overrides))
    model.configure_model()
    return model


def first_batch(model, split="validation"):
    model.setup_data("fit")
    loader = model._train_loader if split == "train" else model._val_loaders[0]
    return next(iter(loader))


def test_batch_loss_counts_answer_tokens_only(tokenizer_file, dtmf_manifest):
    model = tiny_salm(tokenizer_file, dtmf_manifest)
    batch = first_batch(model)
    assert batch["audio"].shape[0] == len(batch["ids"])  # one utterance per conversation
    assert (batch["input_ids"] == model.audio_id).sum() == len(batch["ids"])
    losses, mask = model.forward_step(batch)
    # Targets: each answer's tokens plus <|eot_id|>, i.e. exactly the loss-mask positions.
    assert int(mask.sum()) == int(batch["loss_mask"].sum())
    loss_sum, count = model.loss_step(batch, (losses, mask))
    assert torch.isfinite(loss_sum) and 2.0 < float(loss_sum / count) < 10.0  # ~ln(320) at random init
    answers = dict(zip(batch["tasks"], batch["answers"]))
    if "last_word" in answers:
        assert len(answers["last_word"].split()) == 1


def test_audio_embeddings_start_at_the_scale_of_token_embeddings(tokenizer_file, dtmf_manifest):
    model = tiny_salm(tokenizer_file, dtmf_manifest).eval()
    batch = first_batch(model)
    with torch.no_grad():
        audio, lens = model.perception(batch["audio"], batch["audio_lens"])
    audio_rms = torch.cat([a[:n] for a, n in zip(audio, lens)]).pow(2).mean().sqrt()
    token_rms = model.llm.embedding.word_embeddings.weight.pow(2).mean().sqrt()
    assert 0.5 < float(audio_rms / token_rms) < 2.0


def test_training_steps_reduce_the_loss(tokenizer_file, dtmf_manifest):
    model = tiny_salm(tokenizer_file, dtmf_manifest)
    batch = first_batch(model, "train")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(15):
        loss_sum, count = model.loss_step(batch, model.forward_step(batch))
        loss = loss_sum / count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_kv_cache_generation_equals_recomputation_and_single_rows(tokenizer_file, dtmf_manifest):
    model = tiny_salm(tokenizer_file, dtmf_manifest, seed=3).eval()
    batch = first_batch(model)
    batch = {k: (v[:4] if isinstance(v, torch.Tensor | list) else v) for k, v in batch.items()}
    assert len(set(batch["prompt_lens"].tolist()) | set(batch["audio_lens"].tolist())) > 2  # rows of unequal length
    cached = model.generate(batch, use_cache=True)
    recomputed = model.generate(batch, use_cache=False)
    assert cached == recomputed
    for row in range(4):
        single = {k: (v[row : row + 1] if isinstance(v, torch.Tensor | list) else v) for k, v in batch.items()}
        single["prompt_ids"] = single["prompt_ids"][:, : int(single["prompt_lens"][0])]
        single["audio"] = single["audio"][:, : int(single["audio_lens"][0])]
        assert model.generate(single, use_cache=True) == [cached[row]]  # left padding changes nothing
    sampled = [model.generate(batch, greedy=False, temperature=1.0, top_k=20, use_cache=use,
                              generator=torch.Generator().manual_seed(5)) for use in (True, False)]  # fmt: skip
    assert sampled[0] == sampled[1]
    assert all(len(ids) <= 12 for ids in cached)


def test_freezing_lora_and_frozen_modules_in_eval_mode(tokenizer_file):
    model = tiny_salm(tokenizer_file, freeze=[r"^llm\."])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("perception.") for n in trainable)
    model.train()
    assert not model.llm.training and model.perception.training

    lora = tiny_salm(tokenizer_file, freeze=[r"^llm\.", r"^perception\.encoder\."], freeze_exceptions=["lora_"],
                     lora={"rank": 4, "alpha": 8})  # fmt: skip
    names = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert {n for n in names if n.startswith("llm.")} == {
        f"llm.decoder.layers.{i}.{m}.lora_{ab}" for i in range(2) for ab in "ab"
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    }  # fmt: skip
    assert not any(n.startswith("perception.encoder.") for n in names)
    assert any(n.startswith("perception.adapter.") for n in names) and "perception.proj.weight" in names
    lora.train()
    assert not lora.perception.encoder.training and lora.perception.adapter.training


def test_archive_restores_without_the_sources(tokenizer_file, dtmf_manifest, tmp_path):
    from speechtrain.core.model import SpeechModel

    model = tiny_salm(tokenizer_file, dtmf_manifest, lora={"rank": 4, "alpha": 8}).eval()
    batch = first_batch(model)
    path = model.save_to(tmp_path / "salm.stm")
    restored = SpeechModel.restore_from(path).eval()
    assert type(restored).__name__ == "SALMModel"
    assert restored.cfg.llm.hf_path is None and restored.cfg.perception.asr_model is None
    with torch.no_grad():
        a, b = model.forward_step(batch), restored.forward_step(batch)
    torch.testing.assert_close(a[0], b[0])
    assert model.generate(batch) == restored.generate(batch)


def test_llm_and_encoder_from_hf_folder_and_asr_archive(tokenizer_file, tmp_path):
    from speechtrain.asr.ctc import ConformerCTCModel
    from speechtrain.speechlm.backbone import GPTConfig, build_gpt
    from speechtrain.speechlm.hf import export_hf
    from speechtrain.speechlm.model import SALMModel, prepare_salm_config

    ensure_parallel_state()
    config = tiny_salm_config(tokenizer_file)
    gpt_cfg = GPTConfig(**config["llm"]["config"], seed=77)
    export_hf(build_gpt(gpt_cfg), gpt_cfg, tmp_path / "hf", tokenizer_dir=Path(tokenizer_file).parent)
    torch.manual_seed(5)
    asr = ConformerCTCModel({"tokenizer": {"vocab": [" ", *"0123456789"]}, "preprocessor": {"n_mels": 16},
                             "encoder": {**config["perception"]["encoder"], "d_model": 24}})  # fmt: skip
    asr.configure_model()
    asr.save_to(tmp_path / "asr.stm")
    from omegaconf import OmegaConf

    from speechtrain.common.config import validate_config
    from speechtrain.speechlm.model import SALMConfig

    cfg = validate_config({**config, "llm": {"hf_path": str(tmp_path / "hf")},
                           "perception": {"asr_model": str(tmp_path / "asr.stm"), "compression": "ctc",
                                          "adapter": {"subsampling": 1, "num_layers": 1}}}, SALMConfig)  # fmt: skip
    prepare_salm_config(cfg)
    assert cfg.perception.encoder.d_model == 24 and cfg.llm.config.hidden_size == 32
    assert cfg.perception.ctc_vocab == 12  # 11 characters + blank
    model = SALMModel(OmegaConf.to_container(cfg))
    model.configure_model()
    reference = build_gpt(gpt_cfg).state_dict()
    for name, tensor in model.llm.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            torch.testing.assert_close(tensor, reference[name], msg=name)
    for name, tensor in asr.encoder.state_dict().items():
        torch.testing.assert_close(model.perception.encoder.state_dict()[name], tensor, msg=name)
    torch.testing.assert_close(model.perception.ctc_head.weight, asr.decoder.weight)
    audio = torch.randn(2, 8000)
    frames, lens = model.perception(audio, torch.tensor([8000, 5000]))
    assert frames.shape[-1] == 32 and bool((lens >= 1).all())  # compressed: one frame per non-blank label run
    # A self-conditioned CTC model's encoder needs its CTC head between layers: refused by name, never run without.
    conditioned = ConformerCTCModel({**asr.cfg, "interctc": {"loss_weights": [0.3], "apply_at_layers": [0],
                                                             "self_conditioning": True}})  # fmt: skip
    conditioned.configure_model()
    conditioned.save_to(tmp_path / "conditioned.stm")
    cfg.perception.asr_model = str(tmp_path / "conditioned.stm")
    with pytest.raises(ValueError, match="self-conditioned CTC model"):
        prepare_salm_config(cfg)


def test_salm_trains_on_a_qwen3_folder(tokenizer_file, dtmf_manifest, tmp_path):
    """A Qwen3 LLM (q/k norms, a head width of its own, YaRN scaling) from a Hugging Face folder: SALM imports it
    and a few training steps lower the loss."""
    from omegaconf import OmegaConf

    from speechtrain.common.config import validate_config
    from speechtrain.speechlm.backbone import GPTConfig, build_gpt
    from speechtrain.speechlm.hf import export_hf
    from speechtrain.speechlm.model import SALMConfig, SALMModel, prepare_salm_config

    ensure_parallel_state()
    config = tiny_salm_config(tokenizer_file, dtmf_manifest)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    qwen3 = GPTConfig(**config["llm"]["config"], kv_channels=16, qk_layernorm=True, rope_scaling=yarn,
                      architecture="qwen3", seed=11)  # fmt: skip
    export_hf(build_gpt(qwen3), qwen3, tmp_path / "qwen3", tokenizer_dir=Path(tokenizer_file).parent)
    cfg = validate_config({**config, "llm": {"hf_path": str(tmp_path / "qwen3")}}, SALMConfig)
    prepare_salm_config(cfg)
    llm = cfg.llm.config
    assert (llm.architecture, llm.qk_layernorm, llm.kv_channels, llm.rope_scaling) == ("qwen3", True, 16, yarn)
    torch.manual_seed(0)
    model = SALMModel(OmegaConf.to_container(cfg))
    model.configure_model()
    assert any(n.endswith("self_attention.q_layernorm.weight") for n, _ in model.llm.named_parameters())
    assert type(model.llm.rotary_pos_emb).__name__ == "ScaledRotaryEmbedding"
    batch = first_batch(model, "train")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(4):
        loss_sum, count = model.loss_step(batch, model.forward_step(batch))
        loss = loss_sum / count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print("qwen3 SALM losses", losses)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses


def test_jsonl_conversations_with_two_audios(tokenizer_file, dtmf_manifest, tmp_path):
    rows = [json.loads(line) for line in open(dtmf_manifest)]
    audio = [str((Path(dtmf_manifest).parent / r["audio_filepath"]).resolve()) for r in rows[:3]]
    conversations = [
        {"conversations": [{"from": "User", "type": "text", "value": "Compare"},
                           {"from": "User", "type": "audio", "value": audio[0], "duration": rows[0]["duration"]},
                           {"from": "User", "type": "audio", "value": audio[1], "duration": rows[1]["duration"]},
                           {"from": "Assistant", "type": "text",
                            "value": f"{rows[0]['text']} and {rows[1]['text']}"}]},
        {"conversations": [{"from": "user", "type": "audio", "value": audio[2]},
                           {"from": "assistant", "type": "text", "value": rows[2]["text"]}]},
    ]  # fmt: skip
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    model = tiny_salm(tokenizer_file, train_ds={"manifest_filepath": None, "conversations_path": str(path)},
                      validation_ds={"manifest_filepath": None, "conversations_path": str(path)})  # fmt: skip
    batch = first_batch(model)
    assert batch["audio"].shape[0] == 3 and batch["tasks"] == ["conversation", "conversation"]
    assert sorted((batch["input_ids"] == model.audio_id).sum(1).tolist()) == [1, 2]
    losses, mask = model.forward_step(batch)
    assert int(mask.sum()) == int(batch["loss_mask"].sum())

    path.write_text('{"conversations": [{"from": "Narrator", "value": "x"}]}\n')
    with pytest.raises(ValueError, match="conv.jsonl:1.*Narrator"):
        model._build_loader(model.cfg.train_ds)


# --------------------------------------------------------------------------- the example script, TP=2 vs TP=1
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_config(tokenizer_file, manifest, tmp_path, devices, tp):
    model = tiny_salm_config(tokenizer_file, manifest)
    model["train_ds"]["shuffle"] = False
    model["optim"] = {"lr": 3e-3, "sched": {"name": "constant", "warmup_steps": 0}}
    return {
        "name": "salm_tiny", "seed": 7, "eval_manifest": str(manifest), "eval_utterances": 8,
        "trainer": {"accelerator": "cpu", "devices": devices, "strategy": {"tensor_model_parallel_size": tp},
                    "max_steps": 4, "max_time": None, "precision": 32, "log_every_n_steps": 1,
                    "limit_val_batches": 1, "val_check_interval": 4, "check_val_every_n_epoch": None,
                    "num_sanity_val_steps": 0, "logger": False, "use_distributed_sampler": False,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "exp_manager": {"exp_dir": str(tmp_path / "exp")},
        "model": model,
    }  # fmt: skip


def _train_losses(run_root: Path) -> list[float]:
    (metrics,) = run_root.glob("salm_tiny/*/metrics.csv")
    with open(metrics) as f:
        return [float(r["reduced_train_loss"]) for r in csv.DictReader(f) if r.get("reduced_train_loss")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tensor_parallel_training_equals_single_process(tokenizer_file, dtmf_manifest, tmp_path):
    env = fresh_launch_env(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")  # not an earlier in-process run's
    losses = {}
    for devices, tp in ((1, 1), (2, 2)):
        folder = tmp_path / f"tp{tp}"
        folder.mkdir()
        (folder / "job.yaml").write_text(
            yaml.safe_dump(_job_config(tokenizer_file, dtmf_manifest, folder, devices, tp))
        )
        command = [sys.executable, str(EXAMPLES / "salm_train.py"), f"--config-path={folder}", "--config-name=job"]
        result = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=280,
                                check=False)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        losses[tp] = _train_losses(folder / "exp")
        assert "Final:" in result.stdout and '"transcribe"' in result.stdout
        assert list((folder / "exp").glob("salm_tiny/*/salm_tiny.stm"))
    assert len(losses[1]) == 4
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(losses[1]), atol=2e-5, rtol=1e-5)
    assert losses[1][-1] < losses[1][0]


def test_generate_cli_on_one_file(tokenizer_file, dtmf_manifest, tmp_path, capsys):
    from speechtrain.speechlm.generate import main

    model = tiny_salm(tokenizer_file, dtmf_manifest)
    path = model.save_to(tmp_path / "salm.stm")
    row = json.loads(open(dtmf_manifest).readline())
    audio = Path(dtmf_manifest).parent / row["audio_filepath"]
    main([f"model_path={path}", f"audio={audio}", "prompt=Transcribe the audio.", "max_new_tokens=5"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # one answer line (random weights: any text)
    main([f"model_path={path}", f"audio={dtmf_manifest}", "task=last_word", "limit=4",
          f"output={tmp_path / 'answers.json'}", "max_new_tokens=4"])  # fmt: skip
    report = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert report["last_word"]["utterances"] == 4.0 and 0.0 <= report["last_word"]["accuracy"] <= 1.0
    assert len(open(tmp_path / "answers.json").readlines()) == 4
    with pytest.raises(SystemExit, match="task=nope"):
        main([f"model_path={path}", f"audio={audio}", "task=nope"])


def test_ctc_compression_averages_label_runs_and_drops_blanks():
    from speechtrain.speechlm.model import ctc_compress

    blank = 3
    labels = torch.tensor([[blank, 0, 0, blank, 1, 1, 0, blank], [2, 2, blank, blank, 2, blank, blank, blank]])
    logits = torch.nn.functional.one_hot(labels, 4).float()
    x = torch.arange(16.0).view(2, 8, 1).expand(2, 8, 2)
    out, lens = ctc_compress(x, torch.tensor([8, 5]), logits, blank)
    assert lens.tolist() == [3, 2]
    assert out[0, :, 0].tolist() == [1.5, 4.5, 6.0]  # frames 1-2, 4-5, 6
    assert out[1, :2, 0].tolist() == [8.5, 12.0]  # frames 0-1 and 4 (the same label after a blank is a new token)
    all_blank = torch.nn.functional.one_hot(torch.full((1, 8), blank), 4).float()
    silent, n = ctc_compress(x[:1], torch.tensor([2]), all_blank, blank)
    assert n.tolist() == [1] and silent[0, 0, 0].item() == 0.5

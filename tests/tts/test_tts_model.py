import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speechtrain.core.archive import read_archive
from speechtrain.core.model import SpeechModel
from speechtrain.tts.distill import CFGDistillationModel
from speechtrain.tts.guidance import cfg_distillation_loss
from speechtrain.tts.model import TTSModel, alignment_loss, beta_binomial_log_prior

JOB = Path(__file__).with_name("tts_tp_job.py")
VOCAB = list(" abcdefghijklmnopqrstuvwxyz'")


def tiny_tts_config(**overrides):
    cfg = {
        "text": {"kind": "chars", "vocab": VOCAB},
        "codec": {"n_fft": 256, "win_length": 256, "hop_length": 128, "n_mels": 20, "num_codebooks": 2,
                  "codebook_size": 16, "griffin_lim_iterations": 4},
        "transformer": {"d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "num_heads": 4, "d_ff": 64,
                        "dropout": 0.0},
        "frame_stacking": 2,
        "inference": {"guidance_scale": 2.0, "temperature": 0.8, "top_k": 5, "max_seconds": 0.5},
    }  # fmt: skip
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    return cfg


def tiny_tts(seed=0, **overrides):
    torch.manual_seed(seed)
    model = TTSModel(tiny_tts_config(**overrides))
    generator = torch.Generator().manual_seed(1)
    model.codec.codebooks.copy_(torch.randn(model.codec.codebooks.shape, generator=generator))
    model.codec.fitted.fill_(True)
    model.configure_model()
    return model


def tiny_batch(model):
    generator = torch.Generator().manual_seed(2)
    texts = ["hello there", "abc"]
    tokens, lens = model.encode_texts(texts)
    audio = 0.1 * torch.randn(2, 4000, generator=generator)
    return {"ids": ["a", "b"], "texts": texts, "text_tokens": tokens, "text_lens": lens, "audio": audio,
            "audio_lens": torch.tensor([4000, 2500])}  # fmt: skip


def test_teacher_forcing_targets_with_frame_stacking():
    model = tiny_tts()  # 2 codebooks of 16 codewords: BOS = 16, EOS = 17; 2 frames per step
    codes = torch.tensor([[[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[11, 12, 0, 0, 0], [13, 14, 0, 0, 0]]])
    tf = model.stack_codes(codes, torch.tensor([5, 2]))
    assert tf["targets"].shape == (2, 3, 2, 2) and tf["step_lens"].tolist() == [3, 2]
    # utterance 0: frames 0..4, EOS at frame 5 (step 2, slot 1)
    assert tf["targets"][0, :, :, 0].tolist() == [[1, 2], [3, 4], [5, 17]]
    assert tf["mask"][0].tolist() == [[True, True], [True, True], [True, True]]
    # utterance 1: frames 0..1, EOS at frame 2, then nothing counts
    assert tf["targets"][1, :, :, 1].tolist() == [[13, 14], [17, 16], [16, 16]]
    assert tf["mask"][1].tolist() == [[True, True], [True, False], [False, False]]
    # inputs: BOS, then the previous step's frames (codebook-major within a frame: slot s * K + k), EOS never fed
    assert tf["inputs"][0].tolist() == [[16, 16, 16, 16], [1, 6, 2, 7], [3, 8, 4, 9]]
    assert tf["inputs"][1, 2].tolist() == [16, 16, 16, 16]


def test_beta_binomial_prior_against_its_formula():
    log_prior = beta_binomial_log_prior(torch.tensor([6, 3]), torch.tensor([10, 4]), scaling=1.0)
    assert log_prior.shape == (2, 10, 6)
    assert torch.allclose(log_prior[0].exp().sum(-1), torch.ones(10), atol=1e-5)
    assert torch.allclose(log_prior[1, :4, :3].exp().sum(-1), torch.ones(4), atol=1e-5)
    assert torch.all(log_prior[1, 4:] == 0) and torch.all(log_prior[1, :, 3:] == 0)  # outside the lengths

    def pmf(k, n, a, b):  # beta-binomial, written out
        beta = lambda x, y: math.gamma(x) * math.gamma(y) / math.gamma(x + y)  # noqa: E731
        return math.comb(n, k) * beta(k + a, n - k + b) / beta(a, b)

    assert math.isclose(log_prior[0, 3, 2].exp().item(), pmf(2, 5, 4.0, 7.0), rel_tol=1e-4)
    means = (log_prior[0].exp() * torch.arange(6.0)).sum(-1)
    assert torch.all(means[1:] > means[:-1])  # the expected text position moves forward along the utterance


def test_alignment_loss_prefers_monotonic_attention():
    steps, tokens = 8, 4
    diagonal = torch.zeros(1, steps, tokens)
    diagonal[0, torch.arange(steps), torch.arange(steps) * tokens // steps] = 1.0  # 2 steps per token, in order
    reverse = diagonal.flip(-1)
    lens, step_lens = torch.tensor([tokens]), torch.tensor([steps])
    good, bad = alignment_loss(diagonal, lens, step_lens), alignment_loss(reverse, lens, step_lens)
    uniform = alignment_loss(torch.full((1, steps, tokens), 1 / tokens), lens, step_lens)
    assert good < uniform < bad
    # Padding beyond the lengths does not matter.
    padded = torch.nn.functional.pad(diagonal, (0, 2, 0, 3), value=0.3)
    torch.testing.assert_close(alignment_loss(padded, lens, step_lens), good)
    # Training adds it, weighted, to the code loss.
    model = tiny_tts(condition_dropout=0.0, prior={"alignment_loss_weight": 0.5})
    batch = tiny_batch(model)
    model.train()
    torch.manual_seed(0)
    logits, tf, align = model.forward_step(batch)
    loss_sum, count = model.loss_step(batch, (logits, tf, align))
    code_sum, _ = model.code_losses(logits, tf)
    assert align > 0 and torch.allclose(loss_sum / count, code_sum / count + 0.5 * align)
    (loss_sum / count).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_prior_fades_out_on_schedule():
    model = tiny_tts(prior={"scaledown_start_step": 10, "end_step": 20})
    assert [model.prior_strength(s) for s in (0, 10, 15, 20, 99)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    lens = torch.tensor([4])
    assert model.prior_bias(lens, torch.tensor([5]), 0.0, (5, 4)) is None
    half = model.prior_bias(lens, torch.tensor([5]), 0.5, (5, 4))
    full = model.prior_bias(lens, torch.tensor([5]), 1.0, (5, 4))
    assert torch.allclose(half.exp(), 0.5 * full.exp() + 0.5)


def test_training_loss_masks_padding_and_dropped_text_is_the_unconditional_model():
    model = tiny_tts(condition_dropout=1.0)
    batch = tiny_batch(model)
    model.train()
    logits, tf, align = model.forward_step(batch)  # every text dropped (probability 1): no alignment loss
    assert align == 0
    model.eval()
    everyone = torch.ones(2, dtype=torch.bool)
    expected, _, _ = model.teacher_forced_logits(batch, dropped=everyone, prior_strength=model.prior_strength(0))
    torch.testing.assert_close(logits, expected)
    loss_sum, count = model.loss_step(batch, (logits, tf, align))
    frames = model.codec.frame_lengths(batch["audio_lens"])
    assert count == (frames + 1).sum() * 2  # real frames + EOS, 2 codebooks each
    assert abs(loss_sum / count - math.log(18)) < 0.5  # near-uniform at initialisation


def test_kv_cache_generation_equals_full_recomputation():
    model = tiny_tts().eval()
    texts = ["hello there", "abc"]
    cached = model.generate_codes(texts, seed=3, use_cache=True)
    full = model.generate_codes(texts, seed=3, use_cache=False)
    assert torch.equal(cached["codes"], full["codes"]) and torch.equal(cached["frame_lens"], full["frame_lens"])
    assert cached["decoder_passes"] == 2 and model.generate_codes(texts, guidance_scale=1.0)["decoder_passes"] == 1
    torch.testing.assert_close(cached["attention"], full["attention"])


def test_synthesis_is_batched_deterministic_and_bounded():
    model = tiny_tts().eval()
    waves = model.synthesize(["hello there", "abc"], seed=5)
    again = model.synthesize(["hello there", "abc"], seed=5)
    assert all(torch.equal(a, b) for a, b in zip(waves, again))
    limit = int(0.5 * model.cfg.sample_rate) + model.cfg.codec.hop_length * 2
    assert all(0 < w.numel() <= limit for w in waves)
    with pytest.raises(ValueError, match="outside|not in|unknown"):
        model.synthesize(["hello 42"])
    with pytest.raises(ValueError, match="empty"):
        model.synthesize([""])


def test_archive_round_trip_synthesises_the_same(tmp_path):
    model = tiny_tts().eval()
    path = model.save_to(tmp_path / "tts.stm")
    restored = SpeechModel.restore_from(path).eval()
    assert type(restored) is TTSModel
    a = model.generate_codes(["hello there"], seed=1)
    b = restored.generate_codes(["hello there"], seed=1)
    assert torch.equal(a["codes"], b["codes"])
    model.synthesize(["abc"])  # synthesis must not add state (e.g. the codec's inverse mel) to the weights
    assert model.state_dict().keys() == restored.state_dict().keys()


def test_distillation_student_learns_the_guided_teacher_and_saves_as_a_plain_tts(tmp_path):
    teacher = tiny_tts(seed=0).eval()
    cfg = {**tiny_tts_config(), "distillation": {"guidance_scale": 2.0, "temperature": 2.0, "kl_weight": 1.0,
                                                  "ce_weight": 0.5}}  # fmt: skip
    student = CFGDistillationModel(cfg, teacher=teacher)
    student.init_from_pretrained(teacher)
    assert "teacher" not in " ".join(student.state_dict())
    assert student.state_dict().keys() == teacher.state_dict().keys()
    batch = tiny_batch(teacher)
    student.eval()
    output = student.forward_step(batch)
    loss_sum, count = student.loss_step(batch, output)
    student_logits, tf, teacher_logits = output
    reference, _ = cfg_distillation_loss(student_logits.flatten(1, 2), teacher_logits[0].flatten(1, 2),
                                         teacher_logits[1].flatten(1, 2), tf["targets"].flatten(1, 2),
                                         tf["mask"].flatten(1, 2), 2.0, 2.0, 1.0, 0.5)  # fmt: skip
    torch.testing.assert_close(loss_sum / count, reference)
    # A few steps lower the loss; the teacher does not move.
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss_sum, count = student.loss_step(batch, student.forward_step(batch))
        optimizer.zero_grad()
        (loss_sum / count).backward()
        optimizer.step()
        losses.append(float(loss_sum.detach() / count))
    assert losses[-1] < 0.7 * losses[0]
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())
    # Saved as an ordinary TTS model that synthesises without guidance.
    path = student.save_to(tmp_path / "student.stm")
    archive = read_archive(path)
    assert archive.config["_target_"] == "speechtrain.tts.model.TTSModel" and "distillation" not in archive.config
    restored = SpeechModel.restore_from(path)
    assert type(restored) is TTSModel and restored.cfg.inference.guidance_scale == 1.0
    assert restored.generate_codes(["abc"])["decoder_passes"] == 1
    for key, value in student.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # (TP parity of the shared blocks: tests/asr/test_asr_conformer.py, default suite)
def test_tensor_parallel_tts_transformer_equals_single_process(tmp_path):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
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
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(b["weights"][name], a["weights"][name], msg=name)  # the same initial weights
    torch.testing.assert_close(b["logits"], a["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b["loss"], a["loss"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(b["attention"], a["attention"], atol=1e-6, rtol=1e-5)
    for name, grad in a["grads"].items():
        assert (b["grads"][name] - grad).norm() <= 1e-4 * grad.norm() + 1e-6, name
    assert torch.equal(a["codes"], b["codes"])  # generation (CFG, sampling, monotonic window) agrees too


def _example(name):
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_JOB = [
    "trainer.max_time=null", "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "model.text.kind=chars",
    "model.transformer.d_model=32", "model.transformer.encoder_layers=1", "model.transformer.decoder_layers=1",
    "model.transformer.num_heads=2", "model.transformer.d_ff=64", "model.train_ds.batch_size=8",
    "model.validation_ds.batch_size=8", "model.val_samples=1", "model.inference.max_seconds=0.5",
    "codec_utterances=16", "model.codec.num_codebooks=2", "model.codec.codebook_size=8", "model.codec.n_mels=20",
    "model.codec.griffin_lim_iterations=2", "model.prior.scaledown_start_step=2", "model.prior.end_step=4",
]  # fmt: skip


def test_tts_train_distill_and_synthesize_scripts_end_to_end(tmp_path, dtmf_manifest, capsys):
    """The example scripts on the DTMF corpus (its digit transcripts read as characters): train, distil, synthesise
    from the command line; TensorBoard gets audio and images; the student archive is a plain TTS model."""
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.tts.synthesize import main as synthesize_main

    conf = Path(__file__).resolve().parents[2] / "examples" / "conf"
    train = _example("tts_train")
    data = [
        f"model.train_ds.manifest_filepath={dtmf_manifest}",
        f"model.validation_ds.manifest_filepath={dtmf_manifest}",
    ]
    job = compose_config(
        conf, "tts_train", [*TINY_JOB, *data, f"exp_manager.exp_dir={tmp_path / 'exp'}"], train.SCHEMA
    )
    teacher = train.main(job)
    (run,) = (tmp_path / "exp" / "tts_demo").iterdir()
    archive = run / "tts_demo.stm"
    assert archive.is_file() and teacher.global_step == 6
    assert teacher.cfg.text.vocab == [" ", *"0123456789"]  # fitted on the transcripts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"audio": 0, "images": 0}).Reload()
    assert "val_audio/0" in events.Tags()["audio"] and "val_attention/0" in events.Tags()["images"]

    distill = _example("tts_cfg_distill")
    job = compose_config(conf, "tts_cfg_distill", [
        "trainer.max_time=null", "trainer.max_steps=3", "trainer.val_check_interval=3",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        f"exp_manager.exp_dir={tmp_path / 'exp'}", f"model.distillation.teacher_path={archive}",
        "model.train_ds.batch_size=8", "model.validation_ds.batch_size=8",
    ], distill.SCHEMA)  # fmt: skip
    student = distill.main(job)
    (student_run,) = (tmp_path / "exp" / "tts_cfg_distill").iterdir()
    restored = SpeechModel.restore_from(student_run / "tts_cfg_distill.stm")
    assert type(restored) is TTSModel and restored.cfg.inference.guidance_scale == 1.0
    changed = [k for k, v in student.state_dict().items() if not torch.equal(v, teacher.state_dict()[k])]
    assert changed and all(torch.equal(v, restored.state_dict()[k]) for k, v in student.state_dict().items())

    out = tmp_path / "wavs"
    synthesize_main([f"model_path={archive}", f"manifest={dtmf_manifest}", "max_utterances=3", f"out_dir={out}"])
    assert len(list(out.glob("*.wav"))) == 3 and len((out / "synthesized.json").read_text().splitlines()) == 3
    assert '"rtf"' in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exactly one of text"):
        synthesize_main([f"model_path={archive}"])
    with pytest.raises(SystemExit, match="outside|not in|unknown"):
        synthesize_main([f"model_path={archive}", "text=hello", f"out_dir={out}"])

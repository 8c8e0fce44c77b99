import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speechtrain.asr.ctc import INTERCTC_OFF, UNET_OFF, ConformerCTCConfig
from speechtrain.asr.ngram import BOS, EOS, NgramLM
from speechtrain.asr.transducer import ConformerTransducerConfig, ConformerTransducerModel
from speechtrain.asr.transducer_decoding import LexiconLM, greedy_batch, word_timestamps
from speechtrain.asr.transducer_loss import rnnt_loss, tdt_loss
from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.core.model import SpeechModel
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import CutBatch, LoaderConfig, read_cuts

DIGITS = [" ", *"0123456789"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(manifest=None, **extra):
    return {
        "size": "debug",
        "tokenizer": {"vocab": DIGITS},
        "preprocessor": {"n_mels": 16, "dither": 0.0},
        "spec_augment": None,
        "encoder": {"d_model": 16, "num_heads": 2, "num_layers": 1, "subsampling_conv_channels": 8,
                    "subsampling_factor": 2, "dropout": 0.0, "dropout_att": 0.0},
        "prediction": {"pred_hidden": 16, "dropout": 0.0},
        "joint": {"joint_hidden": 16, "dropout": 0.0, "fused_batch_size": 2},
        "train_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 8,
                     "batch_duration": None, "num_workers": 0},
        "validation_ds": {"manifest_filepath": str(manifest) if manifest else None, "batch_size": 16,
                          "batch_duration": None},
        **extra,
    }  # fmt: skip


def _model(seed=0, scale=0.0, **extra):
    torch.manual_seed(seed)
    model = ConformerTransducerModel(_config(**extra))
    model.configure_model()
    if scale:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn_like(p))  # an untrained model would only say blank
    return model


def _batch(manifest, model, count=6):
    cuts = read_cuts(LoaderConfig(manifest_filepath=str(manifest))).subset(first=count)
    return AsrCutDataset(model.tokenizer)[CutBatch(cuts, 0)]


@pytest.mark.parametrize("loss", ["rnnt", "tdt"])
def test_sub_batched_joint_equals_the_whole_batch_and_keeps_less_for_backward(dtmf_manifest, loss):
    results = {}
    for fused in (0, 1):
        model = _model(loss=loss, joint={"joint_hidden": 128, "dropout": 0.0, "fused_batch_size": fused})
        batch = _batch(dtmf_manifest, model)
        saved = []

        def pack(tensor, saved=saved):
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            enc, lengths = model.forward_step(batch)
            before = sum(saved)
            loss_sum, count = model.loss_step(batch, (enc, lengths))
        loss_sum.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results[fused] = (loss_sum.detach(), int(count), grads, sum(saved) - before)
    whole, sub = results[0], results[1]
    torch.testing.assert_close(sub[0], whole[0], atol=1e-5, rtol=1e-6)
    assert sub[1] == whole[1] == int(batch["token_lens"].sum())
    for key, grad in whole[2].items():
        torch.testing.assert_close(sub[2][key], grad, atol=1e-5, rtol=1e-5)
    # The whole batch keeps at least the joint's hidden activations, B x T x (U+1) x 128 floats, for the backward
    # pass; sub-batches keep none of them.
    hidden = 6 * int(lengths.max()) * (int(batch["token_lens"].max()) + 1) * 128 * 4
    assert sub[3] < whole[3] - hidden, (sub[3], whole[3], hidden)


def test_loss_step_is_the_per_utterance_loss_on_the_model_outputs(dtmf_manifest):
    model = _model(loss="tdt", sigma=0.05, omega=0.25)
    batch = _batch(dtmf_manifest, model, 3)
    enc, lengths = model.forward_step(batch)
    loss_sum, _ = model.loss_step(batch, (enc, lengths))
    expected = 0.0
    for b in range(3):
        t, u = int(lengths[b]), int(batch["token_lens"][b])
        tokens = batch["tokens"][b : b + 1, :u]
        logits = model.joint(model.joint.enc_proj(enc[b : b + 1, :t])[:, :, None],
                             model.joint.pred_proj(model.prediction(tokens))[:, None])  # fmt: skip
        lp = logits[..., :12].log_softmax(-1)
        label = torch.gather(lp[..., :-1], 3, torch.cat([tokens, tokens[:, :1]], 1)[:, None, :, None].expand(
            -1, t, -1, 1))[..., 0]  # fmt: skip
        args = (lp[..., -1], label)
        tdt = tdt_loss(args[0] - 0.05, args[1] - 0.05, logits[..., 12:].log_softmax(-1), [0, 1, 2, 3, 4],
                       lengths[b : b + 1], batch["token_lens"][b : b + 1])  # fmt: skip
        rnnt = rnnt_loss(*args, lengths[b : b + 1], batch["token_lens"][b : b + 1])
        expected = expected + 0.75 * tdt + 0.25 * rnnt
    torch.testing.assert_close(loss_sum, expected.sum(), atol=1e-4, rtol=1e-5)


def test_hybrid_loss_and_both_heads_decode(dtmf_manifest):
    model = _model(loss="tdt", hybrid=True, ctc_loss_weight=0.4, scale=0.3)
    batch = _batch(dtmf_manifest, model)
    enc, lengths = model.forward_step(batch)
    loss_sum, _ = model.loss_step(batch, (enc, lengths))
    tdt = model.transducer_losses(enc, lengths, batch)
    ctc = model.ctc_losses(model.ctc_log_probs(enc), lengths, batch)
    torch.testing.assert_close(loss_sum, (0.6 * tdt + 0.4 * ctc).sum())
    model.eval()
    transducer_text = model.decode(enc, lengths)
    model.cfg.decoder_type = "ctc"
    assert model.decode(enc, lengths) == model.greedy_decode(enc, lengths) != transducer_text
    with pytest.raises(ValueError, match="decoder_type"):
        ConformerTransducerModel(_config(decoder_type="ctc"))
    with pytest.raises(ValueError, match="intermediate CTC reads the CTC head of a hybrid model"):
        ConformerTransducerModel(_config(interctc={"loss_weights": [0.3], "apply_at_layers": [0]}))


@pytest.mark.parametrize("self_conditioning", [False, True])
def test_hybrid_intermediate_ctc_weights_like_nemo_and_conditions_inference(dtmf_manifest, self_conditioning):
    """model.interctc on a hybrid: loss = (1 - sum w) * ((1 - c) * TDT + c * CTC) + sum w_i * CTC(layer i) (NeMo's
    hybrid weighting); validation reads the final layer; a self-conditioned model conditions in inference too."""
    encoder = {**_config()["encoder"], "num_layers": 3, "conv_norm_type": "layer_norm"}
    interctc = {"loss_weights": [0.2, 0.1], "apply_at_layers": [1, 0], "self_conditioning": self_conditioning}
    model = _model(loss="tdt", hybrid=True, ctc_loss_weight=0.4, scale=0.3, encoder=encoder, interctc=interctc)
    batch = _batch(dtmf_manifest, model)
    model.train()
    enc, lengths, captured = model.forward_step(batch)
    loss_sum, count = model.loss_step(batch, (enc, lengths, captured))
    taps = {}
    hooks = [layer.register_forward_hook(lambda m, args, out, i=i: taps.setdefault(i, out))
             for i, layer in enumerate(model.encoder.layers)]  # fmt: skip
    with torch.no_grad():
        final, _ = model(batch["audio"], batch["audio_lens"])
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(final, enc.detach())
    mask = (torch.arange(lengths.max())[None, :] < lengths[:, None])[:, :, None]
    hybrid = 0.6 * model.transducer_losses(enc, lengths, batch) + 0.4 * model.ctc_losses(
        model.ctc_log_probs(enc), lengths, batch
    )
    layer = {i: model.ctc_losses(model.ctc_log_probs(taps[i] * mask), lengths, batch) for i in (0, 1)}
    expected = 0.7 * hybrid + 0.2 * layer[1] + 0.1 * layer[0]
    torch.testing.assert_close(loss_sum, expected.sum(), rtol=1e-5, atol=1e-4)
    assert int(count) == int(batch["token_lens"].sum())
    model.eval()
    assert len(model.forward_step(batch)) == 2  # validation: the final layer alone
    if self_conditioning:
        with torch.no_grad():
            model.conditioning.weight.zero_()
            model.conditioning.bias.zero_()
        unconditioned = model(batch["audio"], batch["audio_lens"])[0]
        assert not torch.allclose(unconditioned, final, atol=1e-3)  # the inference forward conditions too


def test_frame_stack_runs_the_transducer_on_concatenated_encoder_frames():
    joint = {"joint_hidden": 16, "dropout": 0.0, "fused_batch_size": 2, "frame_stack": 2}
    model = _model(loss="tdt", hybrid=True, joint=joint, scale=0.5)
    assert model.joint.enc_proj.in_features == 2 * 16
    g = torch.Generator().manual_seed(2)
    enc, lengths = torch.randn(3, 9, 16, generator=g), torch.tensor([9, 4, 7])
    tokens, token_lens = torch.randint(0, 11, (3, 5), generator=g), torch.tensor([5, 2, 4])
    batch = {"tokens": tokens, "token_lens": token_lens}
    losses = model.transducer_losses(enc, lengths, batch)
    for b in range(3):  # by hand, one utterance at a time: pairs of frames side by side, an odd one with zeros
        t, u = int(lengths[b]), int(token_lens[b])
        x = torch.cat([enc[b, :t], enc.new_zeros(t % 2, 16)]).reshape(1, -1, 32)
        y = tokens[b : b + 1, :u]
        terms = model._joint_terms(model.joint.enc_proj(x), model.joint.pred_proj(model.prediction(y)), y)
        alone = model._loss_from_terms(*terms, torch.tensor([(t + 1) // 2]), token_lens[b : b + 1])
        torch.testing.assert_close(losses[b], alone[0], atol=1e-5, rtol=1e-5)
    # TDT counts 80 ms frames, CTC (the hybrid's head) 40 ms ones: 3 labels fit 2 stacked frames (duration 0), not
    # 2 encoder frames for CTC.
    assert model.alignable(torch.tensor([4, 2]), torch.tensor([3, 3])).tolist() == [True, False]
    model.eval()
    hyps = model.greedy_hypotheses(enc, lengths)
    for b in range(3):
        assert model.greedy_hypotheses(enc[b : b + 1, : lengths[b]], lengths[b : b + 1])[0] == hyps[b]
        assert all(0 <= f < (int(lengths[b]) + 1) // 2 for f in hyps[b]["starts"])
    with pytest.raises(ValueError, match="frame_stack"):
        ConformerTransducerModel(_config(joint={**joint, "frame_stack": 0}))


@pytest.mark.parametrize("loss,context", [("rnnt", 0), ("tdt", 0), ("tdt", 2)])
def test_batched_greedy_decoding_equals_per_utterance(loss, context):
    prediction = {"pred_hidden": 16, "dropout": 0.0, "context_size": context}
    model = _model(loss=loss, scale=0.5, prediction=prediction).eval()
    g = torch.Generator().manual_seed(1)
    enc = torch.randn(5, 30, 16, generator=g)
    lengths = torch.tensor([30, 7, 22, 1, 15])
    durations = model.durations if loss == "tdt" else None
    hyps, steps = greedy_batch(model.prediction, model.joint, enc, lengths, model.blank, durations, 3)
    assert sum(len(h["ids"]) for h in hyps) > 5
    for b in range(5):
        alone, alone_steps = greedy_batch(model.prediction, model.joint, enc[b : b + 1, : lengths[b]],
                                          lengths[b : b + 1], model.blank, durations, 3)  # fmt: skip
        assert alone[0] == hyps[b] and int(alone_steps[0]) == int(steps[b])
        frames = hyps[b]["starts"]
        assert frames == sorted(frames) and all(0 <= f < lengths[b] for f in frames)
        if loss == "rnnt":  # a frame ends with a blank, or after max_symbols labels: steps = frames + labels - those
            forced = sum(frames.count(f) == 3 for f in set(frames))
            assert int(steps[b]) == int(lengths[b]) + len(hyps[b]["ids"]) - forced
        # at most max_symbols labels on one frame
        assert all(frames.count(f) <= 3 for f in set(frames))


@pytest.mark.parametrize("context", [1, 3])
def test_stateless_prediction_network_reads_only_the_last_labels_and_steps_as_it_trains(context):
    model = _model(loss="tdt", scale=0.5, prediction={"pred_hidden": 16, "dropout": 0.0, "context_size": context})
    prediction = model.prediction.eval()
    assert not any(isinstance(m, torch.nn.LSTM) for m in prediction.modules())
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    with torch.no_grad():
        whole = prediction(tokens)  # (2, 7, 16)
        out, state = prediction.step(torch.full((2,), model.blank), None)
        stepped = [out]
        for u in range(tokens.shape[1]):
            out, state = prediction.step(tokens[:, u], state)
            stepped.append(out)
        torch.testing.assert_close(whole, torch.stack(stepped, dim=1), rtol=1e-5, atol=1e-5)
        changed = tokens.clone()
        changed[:, 0] = 7  # the first label: positions more than `context` labels later cannot see it
        other = prediction(changed)
    torch.testing.assert_close(other[:, context + 1 :], whole[:, context + 1 :], rtol=0, atol=0)
    assert not torch.equal(other[:, 1], whole[:, 1])
    with pytest.raises(ValueError, match="context_size"):
        _model(prediction={"pred_hidden": 16, "context_size": -1})


@pytest.mark.parametrize("context", [0, 2])
def test_label_dropout_replaces_previous_labels_by_the_start_symbol_in_training_only(context):
    cfg = {"pred_hidden": 16, "dropout": 0.0, "context_size": context}
    model = _model(loss="tdt", scale=0.5, prediction={**cfg, "label_dropout": 0.5})
    plain = _model(loss="tdt", scale=0.5, prediction=cfg)  # same seed: same weights
    tokens = torch.randint(0, model.blank, (4, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.eval(), plain.eval()
        torch.testing.assert_close(model.prediction(tokens), plain.prediction(tokens), rtol=0, atol=0)
        model.train()
        torch.manual_seed(7)
        first = model.prediction(tokens)
        torch.manual_seed(7)
        dropped = torch.rand(tokens.shape) < 0.5  # the draw label dropout makes from the same RNG state
        expected = plain.prediction.eval()(tokens.masked_fill(dropped, model.blank))
        torch.manual_seed(7)
        torch.testing.assert_close(model.prediction(tokens), first, rtol=0, atol=0)  # seeded like dropout
    assert 0 < int(dropped.sum()) < tokens.numel()
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    assert not torch.equal(first, plain.prediction(tokens))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="label_dropout"):
            _model(prediction={**cfg, "label_dropout": bad})


def test_tdt_greedy_skips_frames_on_a_model_that_predicts_long_durations():
    model = _model(loss="tdt").eval()
    with torch.no_grad():
        model.joint.out.weight.zero_()
        model.joint.out.bias.zero_()
        model.joint.out.bias[11] = 5.0  # blank
        model.joint.out.bias[12 + 4] = 5.0  # duration 4
    enc, lengths = torch.randn(2, 40, 16), torch.tensor([40, 21])
    model.greedy_decode(enc, lengths)
    assert model.decoding_frames_per_step() == pytest.approx((40 + 21) / (10 + 6))


def test_an_impossible_transcript_is_skipped_and_counted_not_a_nan(dtmf_manifest):
    model = _model(loss="tdt", durations=[1, 2])  # without duration 0, a label needs a frame of its own
    batch = _batch(dtmf_manifest, model, 3)
    batch["audio"], batch["audio_lens"] = batch["audio"][:, :1200], batch["audio_lens"].clamp(max=1200)
    batch["audio_lens"][2] = 0  # and an empty utterance
    del batch["audio_samples"], batch["token_counts"]  # (the collator's host copies: the lengths are edited here)
    enc, lengths = model.forward_step(batch)
    assert (lengths < batch["token_lens"]).all()
    batch["tokens"], batch["token_lens"][0] = batch["tokens"], 1  # the first one fits
    model.on_train_batch_start(batch, 0)  # the epoch's tally of utterances seen
    loss_sum, count = model.loss_step(batch, (enc, lengths))
    loss_sum.backward()
    assert math.isfinite(float(loss_sum.detach())) and int(count) == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert int(model._infeasible) == 2
    model.on_train_epoch_end()
    assert model._infeasible is None  # reported and reset
    # A hybrid model also skips what CTC cannot align (a frame per label), though TDT could.
    hybrid = _model(loss="tdt", hybrid=True)
    enc, lengths = hybrid.forward_step(batch)
    batch["token_lens"][0] = int(lengths[0]) + 1
    loss_sum, count = hybrid.loss_step(batch, (enc, lengths))
    assert int(hybrid._infeasible) == 3 and int(count) == 0 and float(loss_sum.detach()) == 0.0


def test_archive_round_trip_for_every_type_gives_identical_transcripts(tmp_path, dtmf_manifest):
    audio = [r.recording.sources[0].source for r in read_cuts(LoaderConfig(manifest_filepath=str(dtmf_manifest)))]
    for name, extra in {"rnnt": {"loss": "rnnt"}, "tdt": {"loss": "tdt"}, "hybrid": {"hybrid": True}}.items():
        model = _model(scale=0.3, **extra)
        before = model.transcribe(audio[:4])
        model.save_to(tmp_path / f"{name}.stm")
        restored = SpeechModel.restore_from(tmp_path / f"{name}.stm")
        assert type(restored) is ConformerTransducerModel and restored.cfg.loss == model.cfg.loss
        assert restored.transcribe(audio[:4]) == before and any(before), name


def test_word_timestamps_follow_the_alignment(dtmf_manifest):
    model = _model(loss="tdt", scale=0.3)
    audio = [r.recording.sources[0].source for r in read_cuts(LoaderConfig(manifest_filepath=str(dtmf_manifest)))]
    results = model.transcribe_with_timestamps(audio[:3])
    assert model.transcribe_with_timestamps(audio[:3], batch_size=2) == results
    assert [r["text"] for r in results] == model.transcribe(audio[:3]) and any(r["words"] for r in results)
    for result in results:
        assert " ".join(w["word"] for w in result["words"]) == " ".join(result["text"].split())
        times = [t for w in result["words"] for t in (w["start"], w["end"])]
        assert times == sorted(times)
    tok = CharTokenizer(DIGITS)
    ids = tok.encode("12 3")
    words = word_timestamps(tok, ids, [0, 2, 4, 6], [1, 3, 5, 8], 0.04)
    assert words == [{"word": "12", "start": 0.0, "end": 0.12}, {"word": "3", "start": 0.24, "end": 0.32}]


@pytest.mark.parametrize("loss,context", [("rnnt", 0), ("tdt", 0), ("tdt", 1)])
def test_beam_search_with_and_without_an_lm(tmp_path, loss, context):
    prediction = {"pred_hidden": 16, "dropout": 0.0, "context_size": context}
    model = _model(loss=loss, scale=0.5, prediction=prediction).eval()
    enc, lengths = torch.randn(2, 12, 16), torch.tensor([12, 8])
    greedy = model.decode(enc, lengths, "greedy")
    model.cfg.decoding.beam_size = 1
    assert len(model.decode(enc, lengths, "beam")) == 2
    model._transducer_beam = None
    model.cfg.decoding.beam_size = 4
    beam = model.decode(enc, lengths, "beam")
    assert len(beam) == 2 and isinstance(beam[0], str)
    # An LM that only knows "7": with a strong weight, the search prefers hypotheses made of it.
    NgramLM.fit(["7 7 7"] * 5, order=2).write_arpa(tmp_path / "lm.arpa")
    model._transducer_beam = None
    model.cfg.decoding.lm_path, model.cfg.decoding.lm_weight = str(tmp_path / "lm.arpa"), 5.0
    with_lm = model.decode(enc, lengths, "beam")

    def share(texts):
        words = [w for t in texts for w in t.split()]
        return sum(w == "7" for w in words) / max(len(words), 1)

    assert share(with_lm) >= share(beam) and greedy is not None
    # The utterances of a batch are searched together (one joint call and one prediction step per round for all of
    # them); each one's result is the one it gets alone.
    search = model._transducer_beam
    enc, lengths = torch.randn(4, 20, 16) * 2, torch.tensor([20, 1, 13, 7])
    together = search(*model.joint_frames(enc, lengths))
    alone = [search(*model.joint_frames(enc[b : b + 1, : int(lengths[b])], lengths[b : b + 1]))[0] for b in range(4)]
    assert together == alone and any(together)
    assert search(*model.joint_frames(enc[:0], lengths[:0])) == []


def test_flops_count_the_prediction_network_and_joint():
    model = _model(loss="tdt", hybrid=True)
    batch = {"audio_lens": torch.tensor([16000, 8000]), "token_lens": torch.tensor([10, 4])}
    more = {"audio_lens": batch["audio_lens"], "token_lens": torch.tensor([20, 8])}
    base, longer = float(model.flops_per_batch(batch)), float(model.flops_per_batch(more))
    frames = (torch.tensor([16000, 8000]) // 160 + 1 + 1) // 2  # encoder frames (2x)
    extra_cells = int((frames * torch.tensor([10, 4])).sum())
    lstm = 2 * 14 * 4 * 2 * 16 * 16
    proj = 2 * 14 * 16 * 16
    assert longer - base == pytest.approx(3 * (lstm + proj + 2 * extra_cells * 16 * 17), rel=1e-6)


def test_the_example_picks_the_transducer_for_its_configs_and_trains(tmp_path, dtmf_manifest):
    from speechtrain.asr.jobs import asr_model_schema
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema

    conf = EXAMPLES / "conf"
    chosen = {}
    for name in ("asr_train", "asr_train_tdt", "asr_train_rnnt", "asr_train_hybrid"):

        def pick(c, name=name):
            return train_job_schema(chosen.setdefault(name, asr_model_schema(c)))

        cfg = compose_config(conf, name, [], pick)
        assert cfg.model.get("loss") is None if name == "asr_train" else cfg.model.loss in ("tdt", "rnnt")
    assert chosen == {
        "asr_train": ConformerCTCConfig,
        "asr_train_tdt": ConformerTransducerConfig,
        "asr_train_rnnt": ConformerTransducerConfig,
        "asr_train_hybrid": ConformerTransducerConfig,
    }
    schema = train_job_schema(ConformerTransducerConfig)
    demo = compose_config(conf, "asr_train_tdt", [], schema)  # make demo-tdt: the CTC demo's setup with TDT
    assert (demo.model.size, demo.trainer.max_time, demo.model.loss) == ("demo", "00:00:17:00", "tdt")
    demo = compose_config(conf, "asr_train_hybrid", [], schema)  # make demo: TDT + CTC, the half-rate layers kept
    assert (demo.model.hybrid, demo.model.encoder.time_reduce_idx, demo.model.decoding.strategy) == (True, 2, "beam")
    assert demo.model.optim.name == "muon"  # (the 4 steps below train with it)
    assert compose_config(conf, "asr_train_rnnt", [], schema).model.loss == "rnnt"
    tokenizer = tmp_path / "digits.json"
    CharTokenizer(DIGITS).save(tokenizer)
    overrides = [f"exp_manager.exp_dir={tmp_path / 'exp'}", "trainer.max_time=null", "trainer.max_steps=4",
                 "trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                 f"model.tokenizer.path={tokenizer}", f"model.train_ds.manifest_filepath={dtmf_manifest}",
                 "model.train_ds.input_cfg=null",  # the recipe blends builtin:speech: read this manifest alone
                 f"model.validation_ds.manifest_filepath={dtmf_manifest}", "model.size=debug",
                 "model.encoder.d_model=16", "model.encoder.num_layers=1", "model.encoder.num_heads=2",
                 "model.encoder.subsampling_conv_channels=8", "model.encoder.subsampling_factor=2",
                 "model.preprocessor.n_mels=16", "model.prediction.pred_hidden=16", "model.joint.joint_hidden=16",
                 "model.train_ds.batch_size=8", "model.train_ds.batch_duration=null", "model.train_ds.num_workers=0",
                 "model.decoding.lm_order=0", "exp_manager.checkpoint_callback_params.save_top_k=1",
                 *UNET_OFF, *INTERCTC_OFF]  # fmt: skip
    spec = importlib.util.spec_from_file_location("asr_train_example", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # A manifest given over the recipe's blend without input_cfg=null is refused by name, not read with the blend.
    both = compose_config(conf, "asr_train_hybrid", [o for o in overrides if "input_cfg" not in o], schema)
    with pytest.raises(ValueError, match="names its data twice: input_cfg and manifest_filepath="):
        module.main(both)
    cfg = compose_config(conf, "asr_train_hybrid", overrides, schema)
    model = module.main(cfg)
    assert model.cfg.hybrid and model.trainer.global_step == 4
    (archive,) = (tmp_path / "exp" / "asr_hybrid_demo").glob("*/asr_hybrid_demo.stm")
    assert type(SpeechModel.restore_from(archive)) is ConformerTransducerModel
    # The closing metrics beside the report, for tools: make demo records its WERs from them (benchmarks/results.py).
    closing = json.loads((archive.parent / "final_metrics.json").read_text())
    assert {"val_wer", "val_wer_greedy"} <= closing.keys(), closing


def test_finetune_keeps_the_encoder_and_reinitialises_the_decoder_for_a_new_vocabulary(tmp_path, caplog):
    spec = importlib.util.spec_from_file_location("asr_finetune_example", EXAMPLES / "asr_finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    base = _model(loss="tdt")
    letters = tmp_path / "letters.json"
    CharTokenizer([" ", *"abcdefghijkl"]).save(letters)
    with caplog.at_level(logging.INFO):
        model = finetune.finetune_model(base, {"tokenizer": {"path": str(letters)}, "joint": {"fused_batch_size": 1}})
    assert type(model) is ConformerTransducerModel and model.cfg.joint.fused_batch_size == 1
    state, old = model.state_dict(), base.state_dict()
    assert all(torch.equal(state[k], v) for k, v in old.items() if k.startswith("encoder."))
    assert not torch.equal(state["prediction.lstm.weight_hh_l0"], old["prediction.lstm.weight_hh_l0"])
    assert OmegaConf.to_container(model.cfg.durations) == [0, 1, 2, 3, 4]


def test_a_deferred_fine_tune_start_loads_the_prediction_and_joint_networks_too():
    """examples/asr_finetune.py loads the archive's weights when the trainer builds the layers (defer): a
    transducer's prediction and joint networks are built after the encoder and CTC head, and must be loaded too
    (they were left at their random initialisation, so a fine-tune began from a decoder that knew nothing)."""
    spec = importlib.util.spec_from_file_location("asr_finetune_example", EXAMPLES / "asr_finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    base = _model(seed=1, scale=0.1, loss="tdt", hybrid=True)
    model = finetune.finetune_model(base, {}, defer=True)
    assert model.encoder is None  # nothing built yet: the trainer builds it under the parallel layout
    model.configure_model()
    state, old = model.state_dict(), base.state_dict()
    assert state.keys() == old.keys() and any(k.startswith("joint.") for k in old)
    assert all(torch.equal(state[k], v) for k, v in old.items())


def test_an_arpa_file_reads_back_to_the_same_probabilities(tmp_path):
    lm = NgramLM.fit(["a b c", "a c b", "b b a c"], order=3)
    back = NgramLM.read_arpa(lm.write_arpa(tmp_path / "lm.arpa"))
    for word, history in [("c", ("a", "b")), ("a", ()), ("z", ("b",)), ("</s>", ("c",))]:
        assert back.log10_prob(word, history) == pytest.approx(lm.log10_prob(word, history), abs=1e-5)


def test_telemetry_counts_the_transducer_flops_with_the_batches_token_lengths():
    from speechtrain.lightning.telemetry import TelemetryCallback, batch_piece

    model = _model(loss="tdt")
    telemetry = TelemetryCallback()
    telemetry._flops_fn = model.flops_per_batch
    batches = [{"audio": torch.zeros(2, 16000), "audio_lens": torch.tensor([16000, 8000]),
                "token_lens": torch.tensor([10, 4])},
               {"audio": torch.zeros(1, 4000), "audio_lens": torch.tensor([4000]),
                "token_lens": torch.tensor([3])}]  # fmt: skip
    totals = telemetry._interval_totals([batch_piece(b) for b in batches])
    expected = model.flops_per_batch({"audio_lens": torch.tensor([16000, 8000, 4000]),
                                      "token_lens": torch.tensor([10, 4, 3])})  # fmt: skip
    assert totals["flops"] == pytest.approx(float(expected)) and totals["tokens"] == 17


def test_a_transducer_starts_from_a_ctc_models_encoder():
    from speechtrain.asr.ctc import ConformerCTCModel

    torch.manual_seed(1)
    config = {k: v for k, v in _config().items() if k not in ("prediction", "joint")}
    ctc = ConformerCTCModel(config)
    ctc.configure_model()
    for hybrid in (False, True):
        model = _model(hybrid=hybrid)
        report = model.init_from_pretrained(ctc)
        assert all(
            torch.equal(model.state_dict()[k], v) for k, v in ctc.state_dict().items() if k.startswith("encoder")
        )
        # the CTC head becomes the hybrid model's CTC head; a plain transducer has none
        assert ("decoder.weight" in report.loaded) is hybrid and ("decoder.weight" in report.unexpected) is not hybrid


@pytest.mark.parametrize("kind", ["chars", "bpe"])
def test_lexicon_lm_adds_up_to_the_word_lm_score_token_by_token(tmp_path, kind):
    from speechtrain.common.tokenizers import load_tokenizer, train_sentencepiece

    texts = ["the cat sat", "the cat ran", "a dog sat", "the dog ran far", "a cat sat far"] * 4
    lm = NgramLM.fit(texts, order=3)
    if kind == "chars":
        tokenizer = CharTokenizer.from_texts(texts)
    else:
        tokenizer = load_tokenizer(train_sentencepiece(texts, tmp_path / "bpe", vocab_size=20))
    lexicon = LexiconLM(lm, tokenizer, weight=0.7, word_score=0.25)

    def run(text):
        state, total = ((), 0, 0.0), 0.0
        for label in tokenizer.encode(text):
            moved = lexicon.advance(state, label)
            if moved is None:
                return None
            state, total = moved[0], total + moved[1]
        end = lexicon.finish(state)
        return None if end is None else total + end

    # The look-ahead telescopes: a whole sentence adds exactly weight * ln p(sentence) + word_score per word.
    for text in ["the cat sat far", "a dog ran"]:
        words = text.split()
        exact = sum(lm.log10_prob(w, (BOS, *words[:i])[-2:]) for i, w in enumerate(words))
        exact += lm.log10_prob(EOS, tuple(words[-2:]))
        assert run(text) == pytest.approx(0.7 * math.log(10) * exact + 0.25 * len(words), abs=1e-9)
    # Within a word the score is the best word below the prefix, for this history.
    (_, node, held), _ = lexicon.advance(((), 0, 0.0), tokenizer.encode("the cat")[0])
    below = [
        w
        for w in ("the", "cat", "sat", "a", "dog", "ran", "far")
        if tokenizer.encode(w)[0] == tokenizer.encode("the")[0]
    ]
    assert held == pytest.approx(0.7 * math.log(10) * max(lm.log10_prob(w, (BOS,)) for w in below))
    # Words the LM does not know cannot be spelled, nor can a sentence end inside one.
    assert run("the cot sat") is None and run("the ca") is None


def test_an_lm_whose_words_the_tokenizer_cannot_spell_is_a_clear_error():
    lm = NgramLM.fit(["xyz zyx"], order=2)
    with pytest.raises(ValueError, match="no word the tokenizer can spell"):
        LexiconLM(lm, CharTokenizer.from_texts(["abc cab"]), weight=0.3, word_score=0.0)

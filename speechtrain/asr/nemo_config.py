"""NeMo training YAMLs, translated into speechtrain's config: never imported, refused key by key.

A NeMo ASR config (e.g. ``fast-conformer_ctc_bpe.yaml``, or a transducer's: ``fast-conformer_transducer_bpe.yaml``,
``fastconformer_hybrid_tdt_ctc_bpe.yaml``, which build a :class:`~speechtrain.asr.transducer.ConformerTransducerModel`)
names NeMo classes (``_target_:
nemo.collections.asr.modules.ConformerEncoder``) and uses NeMo's key names (``n_layers``, ``n_heads``, ``feat_in``,
``tokenizer.dir``, ``optim.sched.name: CosineAnnealing``, ``trainer.strategy: ddp``). The Hydra runner composes it
as usual (overrides in NeMo's names), then :func:`translate_nemo_config` rewrites it into speechtrain's keys:

- every key that has a speechtrain equivalent is mapped, with one log line ``nemo: <key>=<value> -> <our key>``;
- a key whose value is what speechtrain always does (``self_attention_model: rel_pos``, ``untie_biases: true``),
  or that only tunes something speechtrain does otherwise (``pin_memory``, ``log_prediction``), is logged as such;
- every key or value that speechtrain cannot honour (``self_attention_model: abs_pos``, a Citrinet encoder,
  ``optim.name: novograd``, an unknown key) is collected, and the job stops with one message listing them all.

Nothing named by a ``_target_`` is ever imported: the class name only selects the translation table.
"""

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from speechtrain.common.config import ConfigError

logger = logging.getLogger(__name__)

NEMO_PREFIX = "nemo."
MISSING = "???"

# The NeMo classes whose configs have a speechtrain equivalent (by the last part of the ``_target_`` name).
TARGETS = {
    "preprocessor": ("AudioToMelSpectrogramPreprocessor",),
    "spec_augment": ("SpectrogramAugmentation",),
    "encoder": ("ConformerEncoder",),
    "decoder": ("ConvASRDecoder",),
    "prediction network": ("RNNTDecoder",),
    "joint": ("RNNTJoint",),
}


def is_nemo_config(cfg: Any) -> bool:
    """True when ``cfg`` (a mapping) names a NeMo class anywhere (``_target_: nemo....``)."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    if isinstance(cfg, Mapping):
        target = cfg.get("_target_")
        if isinstance(target, str) and target.startswith(NEMO_PREFIX):
            return True
        return any(is_nemo_config(v) for v in cfg.values())
    if isinstance(cfg, list | tuple):
        return any(is_nemo_config(v) for v in cfg)
    return False


class _Refuse(Exception):
    """Raised by a value converter: the value cannot be honoured (the message says why)."""


def _same(*allowed: Any, why: str) -> Callable[[Any], Any]:
    """A check for keys whose only honourable values are ``allowed`` (what speechtrain always does)."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise _Refuse(why)
        return value

    return check


def _one_of(*allowed: Any) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value not in allowed:
            raise _Refuse(f"speechtrain supports {', '.join(map(repr, allowed))}")
        return value

    return check


def _null_or(*allowed: Any, why: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise _Refuse(why)
        return value

    return check


def nemo_context_sizes(value: Any, style: str) -> list[list[int]]:
    """NeMo's ``att_context_size`` (``[left, right]``, a list of them, or null) -> a list of ``[left, right]``
    pairs (streaming: see :class:`~speechtrain.asr.conformer.ConformerConfig`). ``chunked_limited`` needs a right
    context >= 0 (NeMo's own chunking does too)."""
    if value is None:
        return [[-1, -1]]
    sizes = [list(v) for v in value] if value and not isinstance(value[0], int) else [list(value)]
    for size in sizes:
        if len(size) != 2 or not all(isinstance(v, int) and v >= -1 for v in size):
            raise _Refuse(f"expected [left, right] or a list of them (ints >= -1), got {list(value)}")
        if style == "chunked_limited" and size[1] < 0:
            raise _Refuse("chunked_limited attention needs a right context >= 0 (chunks of right + 1 frames)")
    return sizes


def nemo_conv_context(value: Any) -> str | list[int] | None:
    """NeMo's ``conv_context_size`` -> ours: null / ``symmetric`` -> null, ``causal``, or ``[before, after]``."""
    if value is None or value == "symmetric":
        return None
    if value == "causal":
        return "causal"
    if isinstance(value, str) or len(value) != 2:
        raise _Refuse("expected null, 'causal' or [before, after]")
    return [int(value[0]), int(value[1])]


# Rules: NeMo key -> ("map", our key, converter) | ("same", checker, note) | ("drop", note).
# A converter returns the value to store or raises _Refuse.
_DATASET = {
    "manifest_filepath": ("map", "manifest_filepath", None),
    "sample_rate": ("map", "sample_rate", None),
    "batch_size": ("map", "batch_size", None),
    "shuffle": ("map", "shuffle", None),
    "num_workers": ("map", "num_workers", None),
    "max_duration": ("map", "max_duration", None),
    "min_duration": ("map", "min_duration", None),
    "is_tarred": ("map", "is_tarred", None),
    "tarred_audio_filepaths": ("map", "tarred_audio_filepaths", None),
    "shuffle_n": ("map", "shuffle_buffer_size", None),
    "drop_last": ("map", "drop_last", None),
    "seed": ("map", "seed", None),
    # NeMo's lhotse keys are ours already.
    **{
        k: ("map", k, None)
        for k in (
            "cuts_path",
            "shar_path",
            "input_cfg",
            "batch_duration",
            "quadratic_duration",
            "use_bucketing",
            "num_buckets",
            "bucket_duration_bins",
            "bucket_batch_size",
            "bucket_buffer_size",
            "shuffle_buffer_size",
            "min_tps",
            "max_tps",
        )
    },  # fmt: skip
    "use_lhotse": ("drop", "speechtrain always reads data through lhotse"),
    "pin_memory": ("drop", "Lightning moves batches to the device itself"),
    "bucketing_strategy": ("drop", "speechtrain buckets by duration with lhotse (num_buckets, bucket_duration_bins)"),
    "bucketing_batch_size": ("same", _null_or(why="use bucket_batch_size with bucket_duration_bins"), "unused"),
    "bucketing_weights": ("same", _null_or(why="not supported; use input_cfg weights"), "unused"),
    "tarred_shard_strategy": ("same", _one_of("scatter"), "each shard is read by one data-parallel rank per pass"),
    "use_start_end_token": ("same", _same(False, why="CTC transcripts carry no start/end tokens"), "as speechtrain"),
    "trim_silence": ("same", _same(False, why="speechtrain does not trim silence"), "as speechtrain"),
    "max_utts": ("same", _same(0, None, why="limit the manifest itself"), "no limit, as speechtrain"),
}

_PREPROCESSOR = {
    "features": ("map", "preprocessor.n_mels", None),
    "window_size": ("map", "preprocessor.window_size", None),
    "window_stride": ("map", "preprocessor.window_stride", None),
    "n_fft": ("map", "preprocessor.n_fft", None),
    "dither": ("map", "preprocessor.dither", None),
    "sample_rate": ("drop", "the model's sample_rate is used"),
    "normalize": ("map", "preprocessor.normalize", _one_of("per_feature", "none")),
    "window": ("same", _same("hann", why="the window is Hann"), "Hann window"),
    "log": ("same", _same(True, why="features are log-mel"), "log-mel"),
    "frame_splicing": ("same", _same(1, why="frames are not spliced"), "no splicing"),
    "pad_to": ("same", _same(0, why="features are not padded to a multiple of frames; set pad_to: 0"), "no pad"),
    "pad_value": ("same", _same(0, 0.0, why="padding is zeros"), "zero padding"),
}

_SPEC_AUGMENT = {
    "freq_masks": ("map", "spec_augment.freq_masks", None),
    "time_masks": ("map", "spec_augment.time_masks", None),
    "freq_width": ("map", "spec_augment.freq_width", None),
    "time_width": ("map", "spec_augment.time_width", None),
    "rect_masks": ("same", _same(0, why="rectangle masks are not implemented"), "none"),
}

_ENCODER = {
    "n_layers": ("map", "encoder.num_layers", None),
    "d_model": ("map", "encoder.d_model", None),
    "n_heads": ("map", "encoder.num_heads", None),
    "subsampling": ("map", "encoder.subsampling", _one_of("striding", "dw_striding")),
    "subsampling_factor": ("map", "encoder.subsampling_factor", None),
    "subsampling_conv_channels": ("map", "encoder.subsampling_conv_channels", None),
    "ff_expansion_factor": ("map", "encoder.ff_expansion_factor", None),
    "conv_kernel_size": ("map", "encoder.conv_kernel_size", None),
    "conv_norm_type": ("map", "encoder.conv_norm_type", _one_of("batch_norm", "layer_norm")),
    "xscaling": ("map", "encoder.xscaling", None),
    "dropout": ("map", "encoder.dropout", None),
    "dropout_att": ("map", "encoder.dropout_att", None),
    "feat_in": ("drop", "checked against preprocessor.features"),
    "dropout_pre_encoder": ("drop", "checked against dropout"),
    "feat_out": ("same", _same(-1, None, why="the encoder has no output projection"), "no output projection"),
    "causal_downsampling": ("map", "encoder.causal_downsampling", bool),
    "self_attention_model": ("same", _same("rel_pos", why="attention uses relative positions only"), "relative"),
    "att_context_size": ("map", "encoder.att_context_size", lambda v: nemo_context_sizes(v, "regular")),
    "att_context_style": ("map", "encoder.att_context_style", _one_of("regular", "chunked_limited")),
    "att_context_probs": ("map", "encoder.att_context_probs", lambda v: None if v is None else list(v)),
    "untie_biases": ("same", _same(True, why="every layer has its own position biases"), "per-layer biases"),
    "pos_emb_max_len": ("drop", "relative positions are computed for any length"),
    "use_pytorch_sdpa": ("drop", "attention always runs in torch's scaled_dot_product_attention"),
    "use_pytorch_sdpa_backends": ("drop", "torch picks the attention kernel"),
    "conv_context_size": ("map", "encoder.conv_context_size", lambda v: nemo_conv_context(v)),
    "dropout_emb": ("same", _same(0, 0.0, why="there is no position-embedding dropout"), "none"),
    "stochastic_depth_drop_prob": ("same", _same(0, 0.0, why="stochastic depth is not implemented"), "off"),
    "stochastic_depth_mode": ("drop", "stochastic depth is off"),
    "stochastic_depth_start_layer": ("drop", "stochastic depth is off"),
    "reduction": ("same", _same(None, why="intermediate reduction is not implemented"), "none"),
    "reduction_position": ("same", _same(None, why="intermediate reduction is not implemented"), "none"),
    "reduction_factor": ("same", _same(1, why="intermediate reduction is not implemented"), "none"),
    "global_tokens": ("same", _same(0, why="global tokens are not implemented"), "none"),
    "global_tokens_spacing": ("drop", "no global tokens"),
    "global_attn_separate": ("same", _same(False, why="global attention is not implemented"), "none"),
}

_DECODER = {
    "feat_in": ("drop", "the encoder's d_model"),
    "num_classes": ("drop", "the tokenizer's vocabulary size + 1 (blank last)"),
    "vocabulary": ("drop", "the tokenizer's vocabulary"),
}

# Transducers (NeMo's RNNTDecoder, RNNTJoint, loss, decoding and, for hybrids, aux_ctc).
# NeMo's RNN-T loss names (one loss, several implementations) and joint activations, with ours (also read by
# speechtrain.asr.nemo_import for .nemo checkpoints).
RNNT_LOSSES = ("default", "warprnnt", "warprnnt_numba", "pytorch", "graph_rnnt")
JOINT_ACTIVATIONS = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid", "swish": "silu", "silu": "silu"}
_INIT = "an initialisation detail (the LSTM starts from torch's default)"
_PREDNET = {
    "pred_hidden": ("map", "prediction.pred_hidden", None),
    "pred_rnn_layers": ("map", "prediction.pred_rnn_layers", None),
    "dropout": ("map", "prediction.dropout", None),
    "t_max": ("same", _null_or(why="chrono initialisation is not implemented"), "default initialisation"),
    "forget_gate_bias": ("drop", _INIT),
    "weights_init_scale": ("drop", _INIT),
    "hidden_hidden_bias_scale": ("drop", _INIT),
    "rnn_hidden_size": ("same", _same(-1, None, why="an LSTM with a projection is not implemented"), "pred_hidden"),
}
_RNNT_DECODER = {
    "normalization_mode": ("same", _same(None, why="a layer-normalised LSTM is not implemented"), "plain LSTM"),
    "random_state_sampling": ("same", _same(False, why="the LSTM starts from a zero state"), "zero state"),
    "blank_as_pad": ("same", _same(True, why="the blank is the embedding's zero padding row"), "blank as padding"),
    "vocab_size": ("drop", "the tokenizer's vocabulary"),
}


def _joint_activation(value: Any) -> str:
    if str(value).lower() not in JOINT_ACTIVATIONS:
        raise _Refuse(f"speechtrain's joint supports {', '.join(JOINT_ACTIVATIONS)}")
    return JOINT_ACTIVATIONS[str(value).lower()]


_JOINT = {
    "log_softmax": ("drop", "the loss and the decoders take their own log-softmax"),
    "preserve_memory": ("drop", "sub-batches (fused_batch_size) bound the joint's memory"),
    "fuse_loss_wer": ("drop", "the joint and the loss always run in sub-batches of joint.fused_batch_size"),
    "experimental_fuse_loss_wer": ("drop", "the joint and the loss always run in sub-batches"),
    "fused_batch_size": ("map", "joint.fused_batch_size", lambda v: 0 if v is None or v < 1 else v),
    "num_classes": ("drop", "the tokenizer's vocabulary size + 1 (blank last)"),
    "vocabulary": ("drop", "the tokenizer's vocabulary"),
    "num_extra_outputs": ("drop", "one duration logit per entry of model.durations (TDT)"),
}
_JOINTNET = {
    "joint_hidden": ("map", "joint.joint_hidden", None),
    "activation": ("map", "joint.activation", _joint_activation),
    "dropout": ("map", "joint.dropout", None),
    "encoder_hidden": ("drop", "the encoder's d_model"),
    "pred_hidden": ("drop", "model.prediction.pred_hidden"),
}
_LOSS_KWARGS = {
    "durations": ("map", "durations", list),
    "sigma": ("map", "sigma", None),
    "omega": ("map", "omega", None),
    "fastemit_lambda": ("same", _same(0, 0.0, why="FastEmit is not implemented"), "off"),
    "clamp": ("same", _same(-1, -1.0, None, why="clamping the joint's gradients is not implemented"), "off"),
}


# NeMo's beam searches (transducer and CTC), all run here as speechtrain's one beam search.
BEAM_STRATEGIES = ("beam", "beam_batch", "maes", "maes_batch", "tsd", "alsd", "malsd_batch", "flashlight",
                   "pyctcdecode")  # fmt: skip


def _decoding_strategy(value: Any) -> str:
    if value in ("greedy", "greedy_batch"):
        return "greedy"
    if value in BEAM_STRATEGIES:
        return "beam"
    raise _Refuse("speechtrain decodes greedy or with its beam search (beam)")


_DECODING = {
    "strategy": ("map", "decoding.strategy", _decoding_strategy),
    "model_type": ("same", _one_of("rnnt", "tdt"), "from model.loss"),
    "durations": ("drop", "model.durations"),
    "preserve_alignments": ("drop", "word timestamps come from transcribe_with_timestamps"),
    "compute_timestamps": ("drop", "word timestamps come from transcribe_with_timestamps"),
    "confidence_cfg": ("drop", "no confidence estimation"),
}
_GREEDY = {
    "max_symbols": ("map", "decoding.max_symbols", None),
    "max_symbols_per_step": ("map", "decoding.max_symbols", None),
    "loop_labels": ("drop", "greedy decoding is always batched (all utterances advance together)"),
    "use_cuda_graph_decoder": ("drop", "greedy decoding is always batched"),
    "preserve_alignments": ("drop", "word timestamps come from transcribe_with_timestamps"),
}
_BEAM = {"beam_size": ("map", "decoding.beam_size", None),
         "beam_alpha": ("map", "decoding.lm_weight", None),
         "beam_beta": ("map", "decoding.word_score", None),
         "kenlm_path": ("same", _null_or(why="the beam search reads an ARPA word n-gram LM: decoding.lm_path"),
                        "no LM"),
         **{k: ("drop", "a detail of NeMo's beam searches; speechtrain runs one beam search (with an optional word "
                        "n-gram LM: decoding.lm_path)")
            for k in ("return_best_hypothesis", "score_norm", "tsd_max_sym_exp", "alsd_max_target_len",
                      "maes_num_steps", "maes_prefix_alpha", "maes_expansion_beta", "maes_expansion_gamma",
                      "softmax_temperature", "search_type", "preserve_alignments")}}  # fmt: skip
_AUX_CTC = {
    "ctc_loss_weight": ("map", "ctc_loss_weight", None),
    "use_cer": ("drop", "validation logs WER and CER of every validation set"),
    "ctc_reduction": ("drop", "the hybrid's CTC term is reduced as its transducer term (model.rnnt_reduction)"),
    "decoding": ("drop", "the CTC head decodes with model.decoding when model.decoder_type=ctc"),
}
_MODEL_DEFAULTS = {
    key: ("drop", "read where it is used (NeMo's configs interpolate it)")
    for key in ("enc_hidden", "pred_hidden", "joint_hidden", "tdt_durations", "num_tdt_durations")
}

_SCHED = {
    "name": ("map", "optim.sched.name", None),
    "warmup_steps": ("map", "optim.sched.warmup_steps", lambda v: 0 if v is None else v),
    "warmup_ratio": ("map", "optim.sched.warmup_ratio", None),
    "min_lr": ("map", "optim.sched.min_lr", None),
    "max_steps": ("map", "optim.sched.max_steps", lambda v: -1 if v is None else v),
    "d_model": ("map", "optim.sched.d_model", None),
    "hold_steps": ("same", _null_or(0, why="hold phases are not implemented"), "none"),
    "hold_ratio": ("same", _null_or(0, 0.0, why="hold phases are not implemented"), "none"),
    "last_epoch": ("same", _same(-1, why="the schedule always starts at step 0 (resume restores it)"), "default"),
}

_OPTIM = {
    "name": ("map", "optim.name", _one_of("adamw", "adam", "sgd")),
    "lr": ("map", "optim.lr", None),
    "betas": ("map", "optim.betas", None),
    "weight_decay": ("map", "optim.weight_decay", None),
    "momentum": ("map", "optim.momentum", None),
}

_CHECKPOINT = {
    "monitor": ("map", "monitor", None),
    "mode": ("map", "mode", None),
    "save_top_k": ("map", "save_top_k", None),
    "save_last": ("map", "save_last", None),
    "every_n_epochs": ("map", "every_n_epochs", None),
    "every_n_train_steps": ("map", "every_n_train_steps", None),
    "filename": ("map", "filename", None),
    "always_save_nemo": ("drop", "the model archive (.stm) is written when training ends"),
    "save_nemo_on_train_end": ("map", "../save_archive_on_train_end", None),
    "save_best_model": ("drop", "the archive holds the final weights; the best checkpoints are kept (save_top_k)"),
}


def _ema(ema: Mapping[str, Any]) -> dict[str, Any]:
    """NeMo's ``exp_manager.ema``: the same keys, but ``cpu_offload`` (the average stays on the weights' device)."""
    ema = dict(ema)
    if ema.pop("cpu_offload", False):
        raise _Refuse("the moving average stays on the weights' device (set cpu_offload=false)")
    unknown = sorted(set(ema) - {"enable", "decay", "every_n_steps", "validate_original_weights"})
    if unknown:
        raise _Refuse(f"no speechtrain equivalent for {unknown}")
    return ema


_EXP_MANAGER = {
    **{
        k: ("map", k, None)
        for k in (
            "exp_dir",
            "name",
            "version",
            "resume_if_exists",
            "resume_ignore_no_checkpoint",
            "resume_from_checkpoint",
            "create_tensorboard_logger",
            "create_checkpoint_callback",
            "create_wandb_logger",
            "wandb_logger_kwargs",
            "create_mlflow_logger",
            "mlflow_logger_kwargs",
            "create_preemption_callback",
        )
    },  # fmt: skip
    "use_datetime_version": ("same", _same(True, why="set exp_manager.version to name the run folder"), "timestamp"),
    "ema": ("map", "ema", _ema),
}


class _Translator:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.refusals: list[str] = []
        self.out: dict[str, Any] = {}

    def refuse(self, key: str, value: Any, why: str) -> None:
        self.refusals.append(f"{key}={_show(value)}: {why}")

    def set(self, dotted: str, value: Any) -> None:
        node = self.out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def apply(self, section: Mapping[str, Any], rules: Mapping[str, tuple], src: str, dst: str) -> None:
        """Translate the keys of ``section`` (at ``src``) by ``rules`` into ``dst``."""
        for key, value in section.items():
            where = f"{src}.{key}"
            rule = rules.get(key)
            if key == "_target_":
                continue
            if rule is None:
                self.refuse(where, value, "no speechtrain equivalent (unknown key)")
                continue
            if rule[0] == "drop":
                self.lines.append(f"nemo: {where}={_show(value)}: not needed ({rule[1]})")
                continue
            if rule[0] == "same":
                try:
                    rule[1](value)
                except _Refuse as refusal:
                    self.refuse(where, value, str(refusal))
                else:
                    self.lines.append(f"nemo: {where}={_show(value)}: what speechtrain does ({rule[2]})")
                continue
            _, target, convert = rule
            try:
                converted = convert(value) if convert is not None else value
            except _Refuse as refusal:
                self.refuse(where, value, str(refusal))
                continue
            if converted == MISSING:
                self.lines.append(f"nemo: {where} is not set (???): left empty")
                converted = None
            our = f"{dst.rsplit('.', 1)[0]}.{target[3:]}" if target.startswith("../") else f"{dst}.{target}"
            self.set(our, converted)
            self.lines.append(f"nemo: {where}={_show(value)} -> {our}={_show(converted)}")

    def module(self, section: Any, kind: str, rules: Mapping[str, tuple], src: str, dst: str = "model") -> None:
        if section is None:
            return
        target = str(section.get("_target_", ""))
        if target.rsplit(".", 1)[-1] not in TARGETS[kind]:
            self.refuse(f"{src}._target_", target, f"speechtrain has no {target.rsplit('.', 1)[-1] or 'such'} "
                        f"{kind}; it translates {', '.join(TARGETS[kind])}")  # fmt: skip
            return
        self.lines.append(f"nemo: {src}._target_={target}: translated, never imported")
        self.apply(section, rules, src, dst)


def _show(value: Any) -> str:
    text = str(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def translate_nemo_config(cfg: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """``cfg``, a composed NeMo ASR training config, as a speechtrain job config (plain dict).

    Logs one line per key (mapped, or matching what speechtrain does, or not needed and why).

    Raises:
        ConfigError: listing every key or value that cannot be honoured, with the reason.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    t = _Translator()
    for key, value in cfg.items():
        if key in ("name", "seed"):
            t.set(key, value)
            t.lines.append(f"nemo: {key}={_show(value)} -> {key}")
        elif key == "model":
            _model(t, value or {})
        elif key == "trainer":
            _trainer(t, value or {})
        elif key == "exp_manager":
            _exp_manager(t, value or {})
        elif key == "hydra":
            t.lines.append("nemo: hydra: not needed (speechtrain's runner keeps no Hydra output folder)")
        else:
            t.refuse(key, value, "no speechtrain equivalent (unknown key)")
    for line in t.lines:
        logger.info(line)
    if t.refusals:
        raise ConfigError(
            f"This NeMo config has {len(t.refusals)} setting(s) speechtrain cannot honour:\n  "
            + "\n  ".join(t.refusals)
            + "\nChange them in the YAML or with overrides (NeMo's key names), e.g. model.encoder.n_layers=17."
        )
    logger.info("nemo: translated %d keys into speechtrain's config", len(t.lines))
    return t.out


_INTERCTC = {key: ("map", key, lambda value: list(value or [])) for key in ("loss_weights", "apply_at_layers")}


def _model(t: _Translator, model: Mapping[str, Any]) -> None:
    handled = {"preprocessor", "spec_augment", "encoder", "decoder", "tokenizer", "optim", "interctc", "train_ds",
               "validation_ds", "test_ds", "joint", "loss", "decoding", "aux_ctc", "model_defaults"}  # fmt: skip
    simple = {
        "sample_rate": ("map", "sample_rate", None),
        "ctc_reduction": ("map", "ctc_reduction", _one_of("mean_volume", "mean_batch")),
        "rnnt_reduction": ("map", "ctc_reduction", _one_of("mean_volume", "mean_batch")),  # the whole loss's
        "log_prediction": ("drop", "validation logs WER and CER of every validation set"),
        "skip_nan_grad": ("drop", "a step with non-finite gradients is always skipped on every rank"),
        "compute_eval_loss": ("drop", "validation computes WER and CER, not the loss"),
    }
    t.apply({k: v for k, v in model.items() if k not in handled}, simple, "model", "model")
    for name in ("train_ds", "validation_ds"):
        if model.get(name) is not None:
            t.apply(model[name], _DATASET, f"model.{name}", f"model.{name}")
    if model.get("test_ds") is not None:
        t.lines.append("nemo: model.test_ds: not needed (transcribe a test set: python -m speechtrain.asr.transcribe)")
    t.module(model.get("preprocessor"), "preprocessor", _PREPROCESSOR, "model.preprocessor")
    augment = model.get("spec_augment")
    if augment is None and "spec_augment" in model:
        t.set("model.spec_augment", None)
        t.lines.append("nemo: model.spec_augment=None -> model.spec_augment=None")
    t.module(augment, "spec_augment", _SPEC_AUGMENT, "model.spec_augment")
    encoder = model.get("encoder")
    t.module(encoder, "encoder", _ENCODER, "model.encoder")
    if encoder is not None:
        _check_encoder(t, encoder, model.get("preprocessor") or {})
    if "joint" in model or "loss" in model:
        _transducer(t, model)
    else:
        t.module(model.get("decoder"), "decoder", _DECODER, "model.decoder")
        _decoding(t, model.get("decoding"))
    _tokenizer(t, model.get("tokenizer"))
    t.apply(model.get("interctc") or {}, _INTERCTC, "model.interctc", "model.interctc")
    optim = dict(model.get("optim") or {})
    sched = optim.pop("sched", None)
    t.apply(optim, _OPTIM, "model.optim", "model")
    if sched is None and "optim" in model:
        t.set("model.optim.sched.name", "constant")
        t.lines.append("nemo: model.optim.sched is absent -> model.optim.sched.name=constant")
    elif sched is not None:
        t.apply(sched, _SCHED, "model.optim.sched", "model")


def _decoding(t: _Translator, decoding: Mapping[str, Any] | None) -> None:
    """NeMo's ``decoding`` (CTC or transducer): the strategy, greedy's ``max_symbols``, the beam size."""
    decoding = dict(decoding or {})
    greedy, beam = decoding.pop("greedy", None), decoding.pop("beam", None)
    t.apply(decoding, _DECODING, "model.decoding", "model")
    t.apply(greedy or {}, _GREEDY, "model.decoding.greedy", "model")
    t.apply(beam or {}, _BEAM, "model.decoding.beam", "model")


def _transducer(t: _Translator, model: Mapping[str, Any]) -> None:
    """A transducer's sections: the prediction network (``decoder``), ``joint``, ``loss``, ``decoding``,
    ``model_defaults`` and, for a hybrid, ``aux_ctc`` (its CTC head)."""
    if "rnnt_reduction" not in model:
        t.set("model.ctc_reduction", "mean_batch")
        t.lines.append("nemo: model.rnnt_reduction is absent -> model.ctc_reduction=mean_batch (NeMo's default)")
    decoder = model.get("decoder")
    if decoder is not None:
        decoder = dict(decoder)
        prednet = decoder.pop("prednet", None) or {}
        t.module(decoder, "prediction network", _RNNT_DECODER, "model.decoder", "model")
        t.apply(prednet, _PREDNET, "model.decoder.prednet", "model")
    joint = model.get("joint")
    if joint is not None:
        joint = dict(joint)
        jointnet = joint.pop("jointnet", None) or {}
        t.module(joint, "joint", _JOINT, "model.joint", "model")
        t.apply(jointnet, _JOINTNET, "model.joint.jointnet", "model")
    loss = dict(model.get("loss") or {})
    name = loss.pop("loss_name", "default")
    if name == "tdt" or name in RNNT_LOSSES:
        ours = "tdt" if name == "tdt" else "rnnt"
        t.set("model.loss", ours)
        t.lines.append(f"nemo: model.loss.loss_name={name} -> model.loss={ours}")
    else:
        t.refuse("model.loss.loss_name", name, "speechtrain's transducer losses are RNN-T (default) and TDT (tdt)")
    for key, value in loss.items():
        if key.endswith("_kwargs") and isinstance(value, Mapping):
            t.apply(value, _LOSS_KWARGS, f"model.loss.{key}", "model")
        else:
            t.refuse(f"model.loss.{key}", value, "no speechtrain equivalent (unknown key)")
    _decoding(t, model.get("decoding"))
    t.apply(model.get("model_defaults") or {}, _MODEL_DEFAULTS, "model.model_defaults", "model")
    aux = dict(model.get("aux_ctc") or {})
    t.set("model.hybrid", bool(aux))
    t.lines.append(f"nemo: model.aux_ctc {'is set' if aux else 'is absent'} -> model.hybrid={bool(aux)}")
    head = aux.pop("decoder", None)
    t.apply(aux, _AUX_CTC, "model.aux_ctc", "model")
    t.module(head, "decoder", _DECODER, "model.aux_ctc.decoder", "model.decoder")


def _check_encoder(t: _Translator, encoder: Mapping[str, Any], preprocessor: Mapping[str, Any]) -> None:
    feat_in, features = encoder.get("feat_in"), preprocessor.get("features", 80)
    if feat_in is not None and feat_in != features:
        t.refuse("model.encoder.feat_in", feat_in, f"the encoder reads the preprocessor's {features} mel bands")
    pre, dropout = encoder.get("dropout_pre_encoder"), encoder.get("dropout", 0.1)
    if pre is not None and not math.isclose(pre, dropout):
        t.refuse("model.encoder.dropout_pre_encoder", pre, f"pre-encoder dropout is model.encoder.dropout ({dropout})")


def _tokenizer(t: _Translator, tokenizer: Mapping[str, Any] | None) -> None:
    if tokenizer is None:
        return
    for key, value in tokenizer.items():
        if key == "type":
            if value != "bpe":
                t.refuse("model.tokenizer.type", value, "speechtrain reads sentencepiece models (type: bpe) only")
            else:
                t.set("model.tokenizer.type", "bpe")
                t.lines.append("nemo: model.tokenizer.type=bpe -> model.tokenizer.type=bpe (sentencepiece)")
        elif key == "dir":
            if value in (None, MISSING):
                t.lines.append("nemo: model.tokenizer.dir is not set: the training script trains a tokenizer on "
                               "train_ds (model.tokenizer.vocab_size)")  # fmt: skip
                continue
            path = str(Path(value) / "tokenizer.model")
            t.set("model.tokenizer.path", path)
            t.lines.append(f"nemo: model.tokenizer.dir={value} -> model.tokenizer.path={path}")
        else:
            t.refuse(f"model.tokenizer.{key}", value, "no speechtrain equivalent (unknown key)")


def _trainer(t: _Translator, trainer: Mapping[str, Any]) -> None:
    import inspect

    import lightning.pytorch as pl

    arguments = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    for key, value in trainer.items():
        where = f"trainer.{key}"
        if key == "strategy":
            target = str(value.get("_target_", "")) if isinstance(value, Mapping) else ""
            if target.rsplit(".", 1)[-1] == "DDPStrategy":  # NeMo's newer YAMLs: DDPStrategy and its arguments
                value = "ddp"
            if value in ("ddp", "auto", "ddp_find_unused_parameters_true", None):
                t.set(where, {})
                t.lines.append(f"nemo: {where}={value} -> {where}={{}} (the Megatron bridge with TP=PP=1: data "
                               "parallel, gradients all-reduced in buckets)")  # fmt: skip
            else:
                t.refuse(where, value, "speechtrain trains with its Megatron bridge; set ddp (data parallel) and "
                         "trainer.strategy.tensor_model_parallel_size for more")  # fmt: skip
        elif key == "enable_checkpointing":
            t.lines.append(f"nemo: {where}={value}: not needed (exp_manager's checkpoint callback)")
        elif key == "sync_batchnorm":
            t.set(where, False)
            t.lines.append(f"nemo: {where}={value} -> {where}=false (batch norm is masked to valid frames per rank; "
                           "SyncBatchNorm would count padding)")  # fmt: skip
        elif key in arguments:
            t.set(where, value)
            t.lines.append(f"nemo: {where}={_show(value)} -> {where} (Lightning's own argument)")
        else:
            t.refuse(where, value, "not an argument of lightning.Trainer")
    t.set("trainer.use_distributed_sampler", False)
    t.lines.append(
        "nemo: trainer.use_distributed_sampler=false added (the lhotse samplers shard by data-parallel rank)"
    )


def _exp_manager(t: _Translator, exp: Mapping[str, Any]) -> None:
    exp = dict(exp)
    params = exp.pop("checkpoint_callback_params", None)
    t.apply(exp, _EXP_MANAGER, "exp_manager", "exp_manager")
    if params is not None:
        t.apply(params, _CHECKPOINT, "exp_manager.checkpoint_callback_params",
                "exp_manager.checkpoint_callback_params")  # fmt: skip


def translate_if_nemo(cfg: DictConfig) -> DictConfig | dict[str, Any]:
    """``cfg`` translated (:func:`translate_nemo_config`) when it is a NeMo training YAML, else ``cfg``: the hook the
    ASR scripts give their Hydra runner."""
    return translate_nemo_config(cfg) if is_nemo_config(cfg) else cfg

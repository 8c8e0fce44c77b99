"""SALM: a speech-augmented LLM. Audio perception feeds a Megatron GPT backbone through audio placeholders.

Data flow of a training step::

    audio (N, T) --log-mel + Conformer encoder (from an ASR archive)--> (N, F, d_enc)
                 --[CTC compression: average runs of one greedy CTC label, drop blanks]-->
                 --modality adapter: stack `subsampling` frames, Conformer layers--> --Linear--> (N, F', d_llm)
    chat-formatted ids (B, L) with <|audioplaceholder|> --LLM word embeddings--> (B, L, d_llm)
    inject_audio: each placeholder replaced by one utterance's frames, labels = next token where the loss mask is set
    GPTModel(decoder_input=...) --vocab-parallel cross-entropy--> loss = summed CE / number of target tokens

* The LLM comes from a Hugging Face folder (``llm.hf_path``: Llama / Qwen2 / Qwen3 ``config.json``, safetensors,
  tokenizer files; :mod:`speechtrain.speechlm.hf`) or is built from ``llm.config`` with ``llm.tokenizer``. The
  archive keeps only what rebuilds the model: the resolved config, the tokenizer files and the weights; the HF
  folder and the ASR archive are not needed to restore it.
* Training control: ``freeze`` regexes (with ``freeze_exceptions``) over parameter names such as ``^llm\\.``,
  ``^perception\\.encoder\\.``; optional ``lora`` on the LLM's linear layers (tensor-parallel aware); frozen
  modules stay in eval mode; the optimiser sees trainable parameters only.
* Tensor parallelism applies to the LLM (Megatron) and to the Conformer encoder; the model is one pipeline stage.
* Evaluation generates answers (greedy, or top-k / temperature sampling) with Megatron's static KV cache, in
  left-padded batches, and reports WER for transcription tasks and exact-match accuracy for the others.
"""

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from speechtrain.asr.conformer import ConformerConfig, ConformerEncoder, ConformerLayer, frame_mask
from speechtrain.asr.features import PreprocessorConfig, build_preprocessor
from speechtrain.common.batch import is_empty_batch
from speechtrain.common.metrics import edit_distance
from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.data.audio_text import SkipTally
from speechtrain.data.lhotse_loader import get_lhotse_dataloader_from_config, read_cuts
from speechtrain.lightning import parallel_state
from speechtrain.nn.init import seeded
from speechtrain.speechlm.backbone import GPTConfig, build_gpt, gpt_logits
from speechtrain.speechlm.data import (
    SalmDataset,
    SalmLoaderConfig,
    SalmTaskConfig,
    check_tasks,
    conversation_cuts,
    total_length_constraint,
)
from speechtrain.speechlm.injection import inject_audio
from speechtrain.speechlm.lora import LoRAConfig, apply_lora, freeze_parameters, set_frozen_modules_eval
from speechtrain.speechlm.prompts import get_template
from speechtrain.speechlm.tokenizer import LLMTokenizer

logger = logging.getLogger(__name__)


@dataclass
class AdapterConfig:
    """Modality adapter: ``subsampling`` consecutive encoder frames are stacked and projected (1: none), then
    ``num_layers`` Conformer layers of the encoder's shape."""

    subsampling: int = 2
    num_layers: int = 2


@dataclass
class PerceptionConfig:
    """Audio perception. ``asr_model``: an ASR archive (``.stm``, or a NeMo Conformer/FastConformer ``.nemo``) whose
    preprocessor and encoder shape and weights are taken (its ``preprocessor`` / ``encoder`` replace those given
    here), and its CTC head with ``compression: ctc`` (CTC compression: about one LLM position per recognised token
    instead of one per frame).
    """

    asr_model: str | None = None
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    compression: str = "none"  # "ctc": average runs of frames with the same greedy CTC label, drop blank runs
    ctc_vocab: int | None = None  # the CTC head's outputs, blank last (taken from asr_model)


@dataclass
class LLMConfig:
    """The backbone: ``hf_path`` (a Hugging Face checkpoint folder on local disk), or ``config`` + ``tokenizer``
    (a ``tokenizer.json``; ``tokenizer_config.json`` next to it is read when present)."""

    hf_path: str | None = None
    config: GPTConfig = field(default_factory=GPTConfig)
    tokenizer: str | None = None
    tokenizer_config: str | None = None


@dataclass
class GenerationConfig:
    """Answer generation: greedy, or sampling with ``temperature`` over the ``top_k`` most likely tokens."""

    max_new_tokens: int = 64
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    batch_size: int = 16


def _default_tasks() -> list[SalmTaskConfig]:
    return [SalmTaskConfig()]


def _default_freeze() -> list[str]:
    return [r"^llm\."]


@dataclass
class SALMConfig:
    """Config of :class:`SALMModel` (see the module docstring)."""

    sample_rate: int = 16000
    prompt_format: str = "llama3"
    system_prompt: str | None = None
    tasks: list[SalmTaskConfig] = field(default_factory=_default_tasks)
    perception: PerceptionConfig = field(default_factory=PerceptionConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    freeze: list[str] = field(default_factory=_default_freeze)
    freeze_exceptions: list[str] = field(default_factory=list)
    lora: LoRAConfig | None = None
    max_tokens: int = 512
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    val_generate_batches: int = 4
    train_ds: SalmLoaderConfig = field(
        default_factory=lambda: SalmLoaderConfig(batch_duration=None, batch_tokens=4000)
    )
    validation_ds: SalmLoaderConfig = field(
        default_factory=lambda: SalmLoaderConfig(batch_size=16, use_bucketing=False, shuffle=False)
    )
    optim: OptimConfig = field(default_factory=OptimConfig)


def prepare_salm_config(model_cfg: Any) -> None:
    """Fill in what ``llm.hf_path`` and ``perception.asr_model`` imply (the LLM's shape and tokenizer files, the
    ASR model's preprocessor and encoder shape), in place, before the model is built."""
    from speechtrain.speechlm.hf import gpt_config_from_hf

    llm = model_cfg.llm
    if llm.hf_path:
        folder = Path(llm.hf_path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model.llm.hf_path={folder}: no config.json there (a Hugging Face checkpoint "
                                    "folder with config.json, safetensors weights and tokenizer files).")  # fmt: skip
        hf = gpt_config_from_hf(folder)
        llm.config = OmegaConf.structured(dataclasses.replace(hf, transformer_engine=llm.config.transformer_engine))
        llm.tokenizer = str(folder / "tokenizer.json")
        config = folder / "tokenizer_config.json"
        llm.tokenizer_config = str(config) if config.is_file() else None
    asr = model_cfg.perception.asr_model
    if asr:
        from speechtrain.core.archive import read_model_file

        archive = read_model_file(asr)
        stored = archive.config
        if "encoder" not in stored or "preprocessor" not in stored:
            raise ValueError(f"model.perception.asr_model={asr}: not an ASR model archive (no encoder/preprocessor).")
        if (stored.get("interctc") or {}).get("self_conditioning"):
            raise ValueError(f"model.perception.asr_model={asr}: a self-conditioned CTC model (interctc."
                             "self_conditioning): its encoder needs its CTC head between layers, which the perception "
                             "does not run; use an ASR model trained without it.")  # fmt: skip
        if model_cfg.perception.compression == "ctc":
            if "decoder.weight" not in archive.state_dict:
                raise ValueError(f"model.perception.asr_model={asr}: compression=ctc needs the ASR model's CTC head, "
                                 "and this one has none (a transducer without a hybrid CTC head); set "
                                 "model.perception.compression=none, or use a CTC or hybrid model.")  # fmt: skip
            model_cfg.perception.ctc_vocab = int(archive.state_dict["decoder.weight"].shape[0])
        model_cfg.perception.preprocessor = OmegaConf.merge(model_cfg.perception.preprocessor, stored["preprocessor"])
        model_cfg.perception.encoder = OmegaConf.merge(model_cfg.perception.encoder, stored["encoder"])
        if stored.get("sample_rate") and stored["sample_rate"] != model_cfg.sample_rate:
            raise ValueError(f"model.sample_rate={model_cfg.sample_rate}, but the ASR model {asr} expects "
                             f"{stored['sample_rate']} Hz.")  # fmt: skip


class ModalityAdapter(torch.nn.Module):
    """Encoder frames (B, F, d) -> (B, F / subsampling, d): frame stacking + projection, then Conformer layers."""

    def __init__(self, cfg: AdapterConfig, encoder: ConformerConfig, seed: int) -> None:
        super().__init__()
        if cfg.subsampling < 1:
            raise ValueError(f"model.perception.adapter.subsampling must be >= 1, got {cfg.subsampling}.")
        self.subsampling = cfg.subsampling
        d = encoder.d_model
        with seeded(seed):
            self.stack = torch.nn.Linear(d * cfg.subsampling, d) if cfg.subsampling > 1 else None
        layers = []
        for index in range(cfg.num_layers):
            with seeded(seed + 1 + index):
                layers.append(ConformerLayer(encoder))
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stack is not None:
            k = self.subsampling
            frames = math.ceil(x.shape[1] / k) * k
            x = F.pad(x, (0, 0, 0, frames - x.shape[1]))
            x = self.stack(x.reshape(x.shape[0], frames // k, k * x.shape[2]))
            lengths = torch.div(lengths + k - 1, k, rounding_mode="floor")
        mask = frame_mask(lengths, x.shape[1])
        x = x * mask[:, :, None]
        for layer in self.layers:
            x = layer(x, mask)
        return x * mask[:, :, None], lengths


def ctc_compress(
    x: torch.Tensor, lengths: torch.Tensor, logits: torch.Tensor, blank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CTC compression: consecutive frames with the same greedy label are averaged into one, runs of blank are
    dropped (an utterance that is all blank keeps one averaged frame). (N, F, D) -> (N, F', D), lengths (N,)."""
    labels = logits.argmax(-1)
    rows = []
    for row in range(x.shape[0]):
        n = max(int(lengths[row]), 1)
        label = labels[row, :n]
        starts = torch.ones(n, dtype=torch.bool, device=x.device)
        starts[1:] = label[1:] != label[:-1]
        segment = starts.cumsum(0) - 1
        count = int(segment[-1]) + 1
        sums = x.new_zeros(count, x.shape[2]).index_add(0, segment, x[row, :n])
        means = sums / torch.bincount(segment, minlength=count).to(x.dtype)[:, None]
        keep = label[starts] != blank
        rows.append(means[keep] if bool(keep.any()) else means.mean(0, keepdim=True))
    new_lengths = torch.tensor([r.shape[0] for r in rows], device=x.device)
    out = x.new_zeros(len(rows), int(new_lengths.max()), x.shape[2])
    for row, values in enumerate(rows):
        out[row, : values.shape[0]] = values
    return out, new_lengths


class AudioPerception(torch.nn.Module):
    """audio (N, T), lengths -> embeddings (N, F', d_llm) and their lengths (N,)."""

    def __init__(self, cfg: PerceptionConfig, sample_rate: int, llm_width: int, seed: int) -> None:
        super().__init__()
        if cfg.compression not in ("none", "ctc"):
            raise ValueError(f"model.perception.compression must be none or ctc, got {cfg.compression!r}.")
        if cfg.compression == "ctc" and not cfg.ctc_vocab:
            raise ValueError("model.perception.compression=ctc needs the ASR model's CTC head: set "
                             "model.perception.asr_model (or ctc_vocab).")  # fmt: skip
        self.preprocessor = build_preprocessor(cfg.preprocessor, sample_rate)
        self.encoder = ConformerEncoder(cfg.encoder, cfg.preprocessor.n_mels, seed)
        self.ctc_head = torch.nn.Linear(cfg.encoder.d_model, cfg.ctc_vocab) if cfg.compression == "ctc" else None
        self.adapter = ModalityAdapter(cfg.adapter, cfg.encoder, seed + 50_000)
        with seeded(seed + 60_000):
            self.proj = torch.nn.Linear(cfg.encoder.d_model, llm_width)

    def output_lengths(self, samples: Any) -> Any:
        """The embeddings :meth:`forward` gives utterances of ``samples`` samples (the arithmetic alone: a tensor
        on any device, or a NumPy array on the host); None with CTC compression, whose lengths depend on the
        recognised labels."""
        if self.ctc_head is not None:
            return None
        frames = self.encoder.output_lengths(self.preprocessor.frame_lengths(samples))
        k = self.adapter.subsampling
        return (frames + k - 1) // k if self.adapter.stack is not None else frames

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats, lengths = self.preprocessor(audio, audio_lens)
        x, lengths = self.encoder(feats, lengths)
        if self.ctc_head is not None:
            x, lengths = ctc_compress(x, lengths, self.ctc_head(x), blank=self.ctc_head.out_features - 1)
        x, lengths = self.adapter(x, lengths)
        return self.proj(x), lengths


class SALMModel(SpeechModel):
    """Speech-augmented LLM (see the module docstring)."""

    NO_TRAINING_DATA = "model.train_ds names no data (manifest_filepath, cuts_path or conversations_path)."

    Config = SALMConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        if cfg.llm.hf_path and not cfg.llm.tokenizer:
            prepare_salm_config(cfg)
        if not cfg.llm.tokenizer:
            raise ValueError("model.llm needs hf_path (a Hugging Face checkpoint folder) or tokenizer (a "
                             "tokenizer.json) with config.")  # fmt: skip
        tokenizer_file = self.register_artifact("llm.tokenizer", cfg.llm.tokenizer)
        if not cfg.llm.tokenizer_config and (tokenizer_file.parent / "tokenizer_config.json").is_file():
            cfg.llm.tokenizer_config = str(tokenizer_file.parent / "tokenizer_config.json")
        if cfg.llm.tokenizer_config:
            self.register_artifact("llm.tokenizer_config", cfg.llm.tokenizer_config)
        self.tokenizer = LLMTokenizer.from_folder(tokenizer_file.parent)
        self.template = get_template(cfg.prompt_format)
        missing = [t for t in self.template.special_tokens if not _has_token(self.tokenizer, t)]
        if missing:
            raise ValueError(f"The LLM tokenizer ({cfg.llm.tokenizer}) lacks the special tokens {missing} that "
                             f"prompt_format={cfg.prompt_format!r} needs; add them to the tokenizer (and "
                             "make sure the LLM's vocab_size covers their ids).")  # fmt: skip
        if self.tokenizer.vocab_size > cfg.llm.config.vocab_size:
            raise ValueError(f"The tokenizer has {self.tokenizer.vocab_size} tokens but the LLM's vocab_size is "
                             f"{cfg.llm.config.vocab_size}.")  # fmt: skip
        check_tasks([OmegaConf.to_object(t) if OmegaConf.is_config(t) else t for t in cfg.tasks])
        self.audio_id = self.tokenizer.audio_id
        self._init_seed = int(torch.randint(0, 2**30, ()).item())
        self.llm: torch.nn.Module | None = None
        self._skips = SkipTally()
        self._train_loader: DataLoader | None = None
        self._val_loaders: list[DataLoader] = []
        self._val_sums: torch.Tensor | None = None

    # ---------------------------------------------------------------------------------------------- layers
    def configure_model(self) -> None:
        """Builds perception and LLM once the parallel layout is known; loads the HF weights and the ASR encoder
        when the config names them; applies LoRA and freezing. Idempotent."""
        if self.llm is not None:
            return
        from speechtrain.lightning.checkpoint import shard_full_state_dict

        cfg = self.cfg
        llm_cfg = GPTConfig(**OmegaConf.to_container(cfg.llm.config))
        self.perception = AudioPerception(OmegaConf.to_object(cfg.perception), cfg.sample_rate, llm_cfg.hidden_size,
                                          self._init_seed)  # fmt: skip
        self.llm = build_gpt(llm_cfg)
        if cfg.llm.hf_path:
            from speechtrain.speechlm.hf import load_hf_weights

            load_hf_weights(self.llm, cfg.llm.hf_path, llm_cfg)
            logger.info("LLM weights loaded from %s", cfg.llm.hf_path)
        self._match_audio_scale()
        if cfg.perception.asr_model:
            from speechtrain.core.archive import read_model_file

            stored = read_model_file(cfg.perception.asr_model).state_dict
            taken = {f"perception.{k}": v for k, v in stored.items() if k.startswith(("encoder.", "preprocessor."))}
            if self.perception.ctc_head is not None:
                taken.update({f"perception.ctc_head.{k[len('decoder.'):]}": v for k, v in stored.items()
                              if k.startswith("decoder.")})  # fmt: skip
            own = self.state_dict()
            taken = {k: v for k, v in shard_full_state_dict(self, taken).items() if k in own}
            self.load_state_dict(taken, strict=False)
            logger.info("Perception initialised from %s (%d tensors).", cfg.perception.asr_model, len(taken))
        if cfg.lora is not None:
            lora = OmegaConf.to_object(cfg.lora) if OmegaConf.is_config(cfg.lora) else cfg.lora
            wrapped = apply_lora(self.llm, lora)
            logger.info("LoRA (rank %d) on %d LLM layers.", lora.rank, len(wrapped))
        report = freeze_parameters(self, list(cfg.freeze), list(cfg.freeze_exceptions))
        tp = parallel_state.tensor_parallel_world_size()
        scope = f"counted on this rank, tensor-parallel shard {parallel_state.tensor_parallel_rank() + 1} of {tp}"
        logger.info("Freezing (%s): %s", scope if tp > 1 else "whole model", report)
        if cfg.perception.asr_model and any(name.startswith("perception.encoder.") for name in report.trainable):
            logger.warning(
                "The pretrained ASR encoder (model.perception.asr_model) is trainable: no model.freeze pattern covers "
                "it. A freeze list given on the command line replaces the YAML's; add '^perception\\.encoder\\.' to "
                "keep it frozen."
            )
        set_frozen_modules_eval(self)

    def _built(self) -> None:
        if self.llm is None:
            self.configure_model()

    def _match_audio_scale(self) -> None:
        """Initialise the projection so that audio embeddings have the RMS of the LLM's token embeddings.

        The adapter's output is layer-normalised (unit RMS); a default-initialised projection then gives audio
        embeddings far larger than token embeddings (over an order of magnitude in the demo), and the LLM's first
        RMSNorm divides the gradient reaching the projection by that size. (An archive's weights replace this anyway.)
        """
        weight = self.llm.embedding.word_embeddings.weight.detach().float()
        stats = torch.stack([weight.pow(2).sum(), torch.tensor(float(weight.numel()))])
        if parallel_state.tensor_parallel_world_size() > 1:  # the embedding is split over the vocabulary
            stats = parallel_state.all_reduce(stats, parallel_state.tensor_parallel_group())
        rms = float((stats[0] / stats[1]).sqrt())
        proj = self.perception.proj
        with seeded(self._init_seed + 60_001), torch.no_grad():  # drawn on the CPU: the same on any device
            proj.weight.copy_(torch.randn(proj.weight.shape, device="cpu") * (rms / math.sqrt(proj.in_features)))
            proj.bias.zero_()

    def train(self, mode: bool = True) -> "SALMModel":
        super().train(mode)
        if mode and self.llm is not None:
            set_frozen_modules_eval(self)  # frozen parts keep eval-mode behaviour (dropout, batch-norm statistics)
        return self

    def archive_identity(self) -> tuple[str, dict[str, Any]]:
        """The archive records the resolved config: the HF folder and the ASR archive are not needed to restore."""
        target, config = super().archive_identity()
        config["llm"]["hf_path"] = None
        config["perception"]["asr_model"] = None
        return target, config

    @property
    def frame_seconds(self) -> float:
        """Seconds of audio per LLM position, for total-length batching (CTC compression: an estimate, ~6
        recognised tokens per second)."""
        p = self.cfg.perception
        if p.compression == "ctc":
            return 0.16 * max(p.adapter.subsampling, 1)
        return p.preprocessor.window_stride * p.encoder.subsampling_factor * max(p.adapter.subsampling, 1)

    # --------------------------------------------------------------------------------------------- forward
    def embed(self, batch: dict[str, Any], padding_side: str = "right", ids_key: str = "input_ids") -> dict[str, Any]:
        """Token embeddings with every audio placeholder replaced by its utterance's perception frames."""
        self._built()
        lens_key = "prompt_lens" if ids_key == "prompt_ids" else "input_lens"
        ids = batch[ids_key]
        tokens = self.llm.embedding.word_embeddings(ids)
        if batch["audio"].shape[0]:
            audio, audio_lens = self.perception(batch["audio"], batch["audio_lens"])
            audio = audio.to(tokens.dtype)
        else:
            audio = tokens.new_zeros(0, 1, tokens.shape[-1])
            audio_lens = torch.zeros(0, dtype=torch.long, device=ids.device)
        loss_mask = batch.get("loss_mask") if ids_key == "input_ids" else None
        out_len = self._spliced_length(batch) if ids_key == "input_ids" else None
        return inject_audio(tokens, ids, batch[lens_key], audio, audio_lens, self.audio_id, loss_mask,
                            pad_multiple=self._pad_multiple(), padding_side=padding_side,
                            input_padding_side="right", out_len=out_len, check=out_len is None)  # fmt: skip

    def _spliced_length(self, batch: dict[str, Any]) -> int | None:
        """The longest row after the audio is spliced in, from what the collator gives on the host (lengths as
        ints, the row of each audio) and the perception's length arithmetic; None where either is missing (a
        batch made by hand, CTC compression, whose lengths depend on the predictions)."""
        samples, counts, rows = batch.get("audio_samples"), batch.get("input_counts"), batch.get("audio_rows")
        if samples is None or counts is None or rows is None:
            return None
        if not len(rows) == len(samples) == batch["audio"].shape[0] or any(r >= len(counts) for r in rows):
            return None  # (a batch edited by hand after collation)
        frames = self.perception.output_lengths(np.asarray(samples, dtype=np.int64)) if samples else None
        if samples and frames is None:
            return None
        spliced = list(counts)
        for row, n in zip(rows, frames.tolist() if frames is not None else [], strict=True):
            spliced[row] += n - 1  # the placeholder becomes the utterance's frames
        return max(spliced, default=0)

    def _pad_multiple(self) -> int:
        sequence_parallel = getattr(getattr(self.llm, "config", None), "sequence_parallel", False)
        return parallel_state.tensor_parallel_world_size() if sequence_parallel else 1

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        if any(t is not None for t in tensors):
            raise ValueError(f"{type(self).__name__} has a single pipeline stage: use pipeline_model_parallel_size=1.")

    def forward_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position cross-entropy (B, L') and the target mask (B, L')."""
        injected = self.embed(batch)
        labels = injected["labels"]
        mask = labels >= 0
        losses = gpt_logits(self.llm, embeddings=injected["embeds"], labels=labels.clamp(min=0))
        return losses.float(), mask

    def loss_step(self, batch: dict[str, Any], output: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        """(summed cross-entropy over target tokens, number of target tokens)."""
        losses, mask = output
        return (losses * mask).sum(), mask.sum()

    # ------------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        batch: dict[str, Any],
        max_new_tokens: int | None = None,
        greedy: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Answer token ids for each row of ``batch`` (``prompt_ids``, ``prompt_lens``, ``audio``, ``audio_lens``),
        stopping at the template's end-of-turn token (not included).

        Rows are left-padded so that they all end at the same position; an attention mask hides the padding. With
        ``use_cache`` the LLM keeps a static KV cache and runs one position per step; without it, it reruns the
        whole sequence each step (same result, for tests).
        """
        from speechtrain.lightning.megatron_compat import import_megatron

        import_megatron()
        from megatron.core.inference.contexts import StaticInferenceContext

        gen = self.cfg.generation
        max_new_tokens = gen.max_new_tokens if max_new_tokens is None else max_new_tokens
        greedy = gen.greedy if greedy is None else greedy
        temperature = gen.temperature if temperature is None else temperature
        top_k = gen.top_k if top_k is None else top_k
        was_training = self.training
        self.eval()
        try:
            injected = self.embed(batch, padding_side="left", ids_key="prompt_ids")
            embeds, lens = injected["embeds"], injected["lens"]
            batch_size, length = embeds.shape[:2]
            total = length + max_new_tokens
            key_pad = torch.arange(total, device=embeds.device)[None, :] < (length - lens)[:, None]  # left padding
            stops = torch.tensor(sorted(self.template.stop_ids(self.tokenizer)), device=embeds.device)
            context = StaticInferenceContext(batch_size, total) if use_cache else None
            out = torch.zeros(batch_size, 0, dtype=torch.long, device=embeds.device)
            done = torch.zeros(batch_size, dtype=torch.bool, device=embeds.device)
            step_input, offset = embeds, 0
            for _ in range(max_new_tokens):
                keys = offset + step_input.shape[1]
                queries = torch.arange(offset, keys, device=embeds.device)
                causal = torch.arange(keys, device=embeds.device)[None, :] > queries[:, None]
                mask = causal[None, None] | key_pad[:, None, None, :keys]
                logits = gpt_logits(self.llm, embeddings=step_input, inference_context=context, attention_mask=mask)
                logits = logits[:, -1].float()
                # TP peers feed the same tokens and stop at the same step whatever their random streams.
                token = parallel_state.same_on_tensor_parallel_ranks(
                    _pick(logits, greedy, temperature, top_k, generator)
                )
                token = torch.where(done, torch.full_like(token, int(stops[0])), token)
                out = torch.cat([out, token[:, None]], dim=1)
                done |= torch.isin(token, stops)
                if bool(done.all()):
                    break
                new = self.llm.embedding.word_embeddings(token[:, None]).to(embeds.dtype)
                if use_cache:
                    context.sequence_len_offset += step_input.shape[1]
                    offset, step_input = keys, new
                else:
                    embeds = torch.cat([embeds, new], dim=1)
                    step_input = embeds
        finally:
            self.train(was_training)
        answers = []
        stop_set = set(stops.tolist())
        for row in out.tolist():
            cut = next((i for i, t in enumerate(row) if t in stop_set), len(row))
            answers.append(row[:cut])
        return answers

    def answer(self, batch: dict[str, Any], **kwargs: Any) -> list[str]:
        """Decoded answers of :meth:`generate`."""
        return [self.tokenizer.decode(ids).strip() for ids in self.generate(batch, **kwargs)]

    # ---------------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        # loss sum, target tokens, correct next tokens, word errors, reference words, exact matches, answers
        self._val_sums = torch.zeros(7, dtype=torch.float64, device=self.device)
        self._val_task_sums: dict[str, list[float]] = {}
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == "fit"
        self._val_generate_limit = self.cfg.val_generate_batches if fitting else None

    def validation_step(self, batch: dict[str, Any] | None, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Teacher-forced loss and next-token accuracy on the answers; for the first ``val_generate_batches``
        batches (all batches in ``trainer.validate``) also generated answers: WER on transcription tasks, exact
        match on the others."""
        if is_empty_batch(batch):
            return
        injected = self.embed(batch)
        labels = injected["labels"]
        logits = gpt_logits(self.llm, embeddings=injected["embeds"]).float()
        mask = labels >= 0
        loss_sum = F.cross_entropy(logits[mask], labels[mask], reduction="sum")
        correct = (logits.argmax(-1)[mask] == labels[mask]).sum()
        sums = [loss_sum.item(), mask.sum().item(), correct.item(), 0.0, 0.0, 0.0, 0.0]
        if self._val_generate_limit is None or batch_idx < self._val_generate_limit:
            hyps = self.answer(batch)
            for hyp, ref, task in zip(hyps, batch["answers"], batch["tasks"]):
                errors, words = edit_distance(ref.split(), hyp.split()), len(ref.split())
                exact = float(hyp.split() == ref.split())
                task_sums = self._val_task_sums.setdefault(task, [0.0, 0.0, 0.0, 0.0])
                for i, value in enumerate((errors, words, exact, 1.0)):
                    task_sums[i] += value
                sums[3] += errors
                sums[4] += words
                sums[5] += exact
                sums[6] += 1
        self._val_sums += torch.tensor(sums, dtype=torch.float64, device=self._val_sums.device)

    def on_validation_epoch_end(self) -> None:
        sums = (
            self._val_sums if self._val_sums is not None else torch.zeros(7, dtype=torch.float64, device=self.device)
        )
        tasks = sorted({t.name for t in self.cfg.tasks} | set(self._val_task_sums) | {"conversation"})
        per_task = torch.tensor([self._val_task_sums.get(t, [0.0] * 4) for t in tasks], dtype=torch.float64)
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum").cpu()
            per_task = self.trainer.strategy.reduce(per_task.to(self.device), reduce_op="sum").cpu()
        loss_sum, count, correct, errors, words, exact, answers = sums.tolist()
        self.log("val_loss", loss_sum / max(count, 1.0), prog_bar=True, sync_dist=True)
        self.log("val_token_acc", correct / max(count, 1.0), sync_dist=True)
        for name, (t_errors, t_words, t_exact, t_count) in zip(tasks, per_task.tolist()):
            if t_count == 0:
                continue
            self.log(f"val_wer_{name}", t_errors / max(t_words, 1.0), sync_dist=True)
            self.log(f"val_acc_{name}", t_exact / t_count, sync_dist=True)
        if answers:
            self.log("val_wer", errors / max(words, 1.0), prog_bar=True, sync_dist=True)

    # ------------------------------------------------------------------------------------------------ data
    def setup_data(self, stage: str) -> None:
        if stage == "fit":
            self._train_loader = self._build_loader(self.cfg.train_ds)
        if stage in ("fit", "validate"):
            loader = self._build_loader(self.cfg.validation_ds, evaluation=True)
            self._val_loaders = [loader] if loader is not None else []

    def dataset(self, ds_cfg: SalmLoaderConfig) -> SalmDataset:
        tasks = [OmegaConf.to_object(t) if OmegaConf.is_config(t) else t for t in self.cfg.tasks]
        return SalmDataset.from_config(
            self.tokenizer, ds_cfg, template=self.cfg.prompt_format, tasks=tasks,
            system_prompt=self.cfg.system_prompt, max_tokens=self.cfg.max_tokens,
        )  # fmt: skip

    def _build_loader(self, ds_node: Any, evaluation: bool = False) -> DataLoader | None:
        from lhotse import CutSet

        from speechtrain.corpora.builtin import resolve_manifest

        cfg = ds_node if isinstance(ds_node, SalmLoaderConfig) else OmegaConf.to_object(ds_node)
        if not (cfg.manifest_filepath or cfg.cuts_path or cfg.shar_path or cfg.input_cfg or cfg.conversations_path):
            return None
        manifests = cfg.manifest_filepath
        if manifests:
            cfg.manifest_filepath = (str(resolve_manifest(manifests)) if isinstance(manifests, str)
                                     else [str(resolve_manifest(m)) for m in manifests])  # fmt: skip
        cfg.sample_rate = self.cfg.sample_rate
        dataset = self.dataset(cfg)
        parts = []
        if cfg.manifest_filepath or cfg.cuts_path or cfg.shar_path or cfg.input_cfg:
            parts.append(read_cuts(cfg, tokenizer=None))
        paths = cfg.conversations_path
        for path in [paths] if isinstance(paths, str) else list(paths or []):
            parts.append(conversation_cuts(path))
        cuts = parts[0] if len(parts) == 1 else CutSet.from_cuts(c for part in parts for c in part)
        return get_lhotse_dataloader_from_config(
            cfg, parallel_state.data_parallel_rank(), parallel_state.data_parallel_world_size(), dataset,
            cuts=cuts, constraint=total_length_constraint(cfg, self.frame_seconds), evaluation=evaluation,
        )  # fmt: skip


def _has_token(tokenizer: LLMTokenizer, token: str) -> bool:
    try:
        tokenizer.token_to_id(token)
    except KeyError:
        return False
    return True


def _pick(logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, generator: Any) -> torch.Tensor:
    """Next token per row: argmax, or a sample at ``temperature`` from the ``top_k`` best (0: all)."""
    if greedy:
        return logits.argmax(-1)
    logits = logits / max(temperature, 1e-5)
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]

"""A reference client of a streaming ONNX export (:mod:`speechtrain.asr.export_onnx_streaming`): ONNX Runtime and
NumPy only, no PyTorch, as a deployment would run it.

    recognizer = OnnxStreamingRecognizer("model_onnx")
    for feats in feature_chunks:          # (n_mels, F) log-mel frames as they come, any F
        partial = recognizer.push(feats)
    final = recognizer.finish()

Features are the model's log-mel frames, not normalised (a streaming model has ``preprocessor.normalize: none``):
NeMo's front end with the settings in ``config.json``. Each step sends the encoder the window the config describes
(``pre_encode_cache_size`` frames before the chunk's ``shift_size`` new ones; zeros before the utterance) and its
caches; the greedy decoders are NeMo's: CTC merges repeats across chunks, the transducer keeps its prediction
network's state and frame pointer between chunks (a TDT duration may step into the next chunk).
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort


class OnnxStreamingRecognizer:
    """Greedy streaming recognition with an exported folder (batch of one).

    Args:
        folder: the export (its ``config.json`` has a ``streaming`` entry).
        decoder_type: ``ctc`` or ``transducer`` for a hybrid export (None: the exported ``model_type``'s).
        providers: ONNX Runtime execution providers (None: CPU).
    """

    def __init__(
        self, folder: str | Path, decoder_type: str | None = None, providers: list[str] | None = None
    ) -> None:
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if "streaming" not in config:
            raise ValueError(f"{folder} holds an offline export (config.json has no 'streaming' entry).")
        self.geometry = g = config["streaming"]
        self.vocab = [line.rsplit(" ", 1)[0].replace("▁", " ")
                      for line in (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()]  # fmt: skip
        self.blank = len(self.vocab) - 1
        kind = decoder_type or ("ctc" if config["model_type"].endswith("ctc") else "transducer")
        providers = providers or ["CPUExecutionProvider"]
        self.transducer = kind == "transducer"
        self.encoder = ort.InferenceSession(str(folder / ("encoder-model.onnx" if self.transducer else "model.onnx")),
                                            providers=providers)  # fmt: skip
        factor = g["subsampling_factor"]
        self.window = g["pre_encode_cache_size"] + g["shift_size"]
        self.feats = np.zeros((config["features_size"], g["drop_extra_pre_encoded"] * factor), np.float32)
        self.feat_start = -g["drop_extra_pre_encoded"] * factor  # absolute index of ``feats``'s first frame
        self.feat_total = 0
        self.done = 0  # encoder frames computed
        self.caches = {
            "cache_last_channel": np.zeros((1, g["num_layers"], g["last_channel_cache_size"], g["d_model"]),
                                           np.float32),
            "cache_last_time": np.zeros((1, g["num_layers"], g["d_model"], g["last_time_cache_size"]), np.float32),
            "cache_last_channel_len": np.zeros(1, np.int64),
        }  # fmt: skip
        self.ids: list[int] = []
        self.chunk_outputs: list[np.ndarray] = []  # each step's logprobs (T, V+1) or encoder frames (T, D)
        if self.transducer:
            self.decoder = _TransducerGreedy(folder, self.blank, config, providers)
        else:
            self.previous = -1

    @property
    def text(self) -> str:
        """The hypothesis so far."""
        return "".join(self.vocab[i] for i in self.ids)

    def push(self, feats: np.ndarray) -> str:
        """Feed (n_mels, F) feature frames; runs every chunk now complete and returns the partial hypothesis."""
        self.feats = np.concatenate([self.feats, np.asarray(feats, np.float32)], axis=1)
        self.feat_total += feats.shape[1]
        while self.feat_total >= self._window_start() + self.window:
            self._step(self.window)
        return self.text

    def finish(self) -> str:
        """End of the stream: the last chunks (the last one shorter), and the final hypothesis."""
        frames = self.feat_total
        for _ in range(int(np.log2(self.geometry["subsampling_factor"]))):
            frames = frames // 2 + 1 if self.geometry["causal_downsampling"] else (frames + 1) // 2
        while self.done < frames:
            self._step(min(self.window, self.feat_total - self._window_start()))
        if self.transducer:
            self.ids = self.decoder.finish()
        return self.text

    def _window_start(self) -> int:
        """The absolute feature frame where the next step's window starts (negative at the start: zeros)."""
        return self.geometry["subsampling_factor"] * (self.done - self.geometry["drop_extra_pre_encoded"])

    def _step(self, width: int) -> int:
        """Run the encoder on ``width`` feature frames from the chunk's window start; returns the frames it gave."""
        start = self._window_start()
        window = self.feats[None, :, start - self.feat_start : start - self.feat_start + width]
        out, lengths, channel, time, channel_len = self.encoder.run(None, {
            "audio_signal": window, "length": np.array([window.shape[2]], np.int64), **self.caches})  # fmt: skip
        count = int(lengths[0])
        if count == 0:
            return 0
        self.caches = {"cache_last_channel": channel, "cache_last_time": time, "cache_last_channel_len": channel_len}
        self.done += count
        keep = self._window_start()
        self.feats, self.feat_start = self.feats[:, keep - self.feat_start :], keep
        frames = out[0, :count] if not self.transducer else out[0, :, :count].T  # (T, V+1) or (T, D)
        self.chunk_outputs.append(frames)
        if self.transducer:
            self.ids = self.decoder.push(frames)
        else:
            for label in frames.argmax(-1).tolist():
                if label != self.blank and label != self.previous:
                    self.ids.append(label)
                self.previous = label
        return count


class _TransducerGreedy:
    """Greedy RNN-T / TDT over encoder frames as they come, with ``decoder_joint-model.onnx`` (``frame_stack`` k:
    frames grouped by k as they arrive, the last group zero-padded)."""

    def __init__(self, folder: Path, blank: int, config: dict, providers: list[str]) -> None:
        self.session = ort.InferenceSession(str(folder / "decoder_joint-model.onnx"), providers=providers)
        self.blank, self.max_symbols = blank, config["max_tokens_per_step"]
        self.stack = config["subsampling_factor"] // config["streaming"]["subsampling_factor"]
        self.tdt = config["model_type"].endswith("tdt")
        shape = next(i.shape for i in self.session.get_inputs() if i.name == "input_states_1")
        layers, hidden = shape[0], shape[2]
        self.states = (np.zeros((layers, 1, hidden), np.float32), np.zeros((layers, 1, hidden), np.float32))
        self.label = blank  # the prediction network reads the blank first
        self.frames: list[np.ndarray] = []  # joint-input frames (k D,) from ``base`` on
        self.base, self.t, self.on_frame = 0, 0, 0
        self.pending = np.zeros((0, 0), np.float32)
        self.ids: list[int] = []

    def push(self, enc: np.ndarray) -> list[int]:
        """(T, D) encoder frames; returns the labels so far."""
        enc = enc if not self.pending.size else np.concatenate([self.pending, enc])
        whole = enc.shape[0] // self.stack * self.stack
        self.pending = enc[whole:]
        self.frames += list(enc[:whole].reshape(-1, self.stack * enc.shape[1]))
        self._run()
        return self.ids

    def finish(self) -> list[int]:
        if self.pending.size:
            group = np.zeros((self.stack, self.pending.shape[1]), np.float32)
            group[: self.pending.shape[0]] = self.pending
            self.frames.append(group.reshape(-1))
            self.pending = np.zeros((0, 0), np.float32)
            self._run()
        return self.ids

    def _run(self) -> None:
        """Decode until the frame pointer passes the frames known so far (NeMo's greedy label looping)."""
        limit = self.base + len(self.frames)
        while self.t < limit:
            frame = self.frames[self.t - self.base][None, :, None]  # (1, k D, 1)
            logits, _, h, c = self.session.run(None, {
                "encoder_outputs": frame, "targets": np.array([[self.label]], np.int32),
                "target_length": np.array([1], np.int32), "input_states_1": self.states[0],
                "input_states_2": self.states[1]})  # fmt: skip
            logits = logits[0, 0, 0]
            token = int(logits[: self.blank + 1].argmax())
            if self.tdt:
                advance = int(logits[self.blank + 1 :].argmax())
                advance = max(advance, 1) if token == self.blank else advance
            else:
                advance = int(token == self.blank)
            if token != self.blank:
                self.ids.append(token)
                self.label, self.states = token, (h, c)
                self.on_frame += 1
                if advance == 0 and self.on_frame >= self.max_symbols:
                    advance = 1
            self.t += advance
            if advance:
                self.on_frame = 0
        drop = self.t - self.base
        if drop > 0:
            self.frames, self.base = (
                self.frames[min(drop, len(self.frames)) :],
                self.base + min(drop, len(self.frames)),
            )

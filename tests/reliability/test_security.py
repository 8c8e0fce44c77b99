"""Files from strangers never run code and never exhaust memory: lhotse cuts naming a command or a URL as their audio
are refused before any audio is read; every checkpoint load is verified; archives and tar shards are read in bounded
memory (the readers run in a child process whose address space is capped); bad tar members, lying manifest
durations and bad manifest lines are skipped (or read in part) and counted; caches built from a manifest follow its
content. Each test records its faults for the summary table (see conftest.py); docs/security.md lists them."""

import ast
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import tiny_ctc_config
from lhotse import CutSet, Recording, SupervisionSegment
from lhotse.audio import AudioSource
from lhotse.cut import MonoCut

from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.data.audio_text import SkipTally, UnsafeAudioSourceError, UtteranceReader, unusable_reason
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import LoaderConfig, get_lhotse_dataloader_from_config
from speechtrain.data.manifest import BadLine, ManifestError, iter_manifest_entries
from speechtrain.data.nemo_adapters import LazyNeMoManifest, LazyNeMoTarredIterator
from speechtrain.lightning import checkpoint

ROOT = Path(__file__).resolve().parents[2]
RATE = 16000
TOKENIZER = CharTokenizer([" ", *"0123456789"])


def _wav(path: Path, seconds: float, seed: int = 0) -> Path:
    noise = np.random.default_rng(seed).uniform(-0.3, 0.3, round(seconds * RATE)).astype(np.float32)
    sf.write(path, noise, RATE, subtype="PCM_16")
    return path


def _cut(cut_id: str, source_type: str, source: str | bytes, seconds: float = 0.5) -> MonoCut:
    recording = Recording(id=cut_id, sources=[AudioSource(type=source_type, channels=[0], source=source)],
                          sampling_rate=RATE, num_samples=round(seconds * RATE), duration=seconds)  # fmt: skip
    supervision = SupervisionSegment(id=cut_id, recording_id=cut_id, start=0.0, duration=seconds, text="12")
    return MonoCut(id=cut_id, start=0.0, duration=seconds, channel=0, recording=recording, supervisions=[supervision])


def _batches(cfg: dict, **kwargs) -> list[dict]:
    cfg = {"batch_size": 4, "use_bucketing": False, "shuffle": False, **cfg}
    return list(get_lhotse_dataloader_from_config(cfg, 0, 1, AsrCutDataset.from_config(TOKENIZER, LoaderConfig(**cfg)),
                                                  **kwargs))  # fmt: skip


def _summary(batches: list[dict]) -> str:
    tally = SkipTally()
    for batch in batches:
        tally.add_batch(batch)
    return tally.take_summary() or ""


# ------------------------------------------------------------------------------------------- audio sources
@pytest.mark.parametrize("kind", ["command", "url"])
def test_a_cut_whose_audio_is_a_command_or_a_url_is_refused_before_any_audio_is_read(tmp_path, kind, fault):
    record = fault(f"lhotse cuts with a {kind!r} audio source (cuts file, Shar, mix, reader)", injected=4)
    marker = tmp_path / "pwned"
    good = _wav(tmp_path / "good.wav", 0.5)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    source = (f"touch {marker}; cat {good}" if kind == "command"
              else f"http://127.0.0.1:{listener.getsockname()[1]}/audio.wav")  # fmt: skip
    evil = _cut("evil-1", kind, source)
    cuts = CutSet.from_cuts([_cut("good-1", "file", str(good)), evil])
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    (tmp_path / "shar").mkdir()
    cuts.to_shar(tmp_path / "shar", fields={}, warn_unused_fields=False)  # cuts only: sources kept as they are
    refused = f"cut 'evil-1': its audio source is of type '{kind}'"
    for cfg in ({"cuts_path": str(tmp_path / "cuts.jsonl.gz")}, {"shar_path": str(tmp_path / "shar")}):
        with pytest.raises(UnsafeAudioSourceError, match=refused):
            _batches(cfg)
    reader = UtteranceReader(TOKENIZER, RATE)
    track = f"(its track 'evil-1'): its audio source is of type '{kind}'"
    with pytest.raises(UnsafeAudioSourceError, match=re.escape(track)):  # any other way to the reader: a mix
        reader.read_cut(_cut("good-2", "file", str(good)).mix(evil))
    with pytest.raises(UnsafeAudioSourceError, match=refused):
        reader.read_cut(evil)
    assert not marker.exists()  # the command never ran
    with pytest.raises(BlockingIOError):
        listener.accept()  # and nothing connected to fetch the URL
    listener.close()
    record.survive(steps_lost=0)


def test_file_memory_and_shar_audio_sources_are_read(tmp_path):
    good = _wav(tmp_path / "good.wav", 0.5)
    file_cut = _cut("file-1", "file", str(good))
    memory_cut = file_cut.with_id("memory-1")
    memory_cut.recording = Recording.from_bytes(good.read_bytes(), recording_id="memory-1")
    (tmp_path / "shar").mkdir()
    CutSet.from_cuts([file_cut]).to_shar(tmp_path / "shar", fields={"recording": "wav"})
    reader = UtteranceReader(TOKENIZER, RATE)
    assert [reader.read_cut(c)["audio"].shape[0] for c in (file_cut, memory_cut)] == [RATE // 2] * 2
    (batch,) = _batches({"shar_path": str(tmp_path / "shar")})
    assert batch["ids"] == ["file-1"] and batch["audio_lens"].tolist() == [RATE // 2]


# ------------------------------------------------------------------------------------ verified loads only
def test_every_checkpoint_load_goes_through_the_verified_path(tmp_path, fault):
    record = fault("bit-flipped .ckpt given to init_from / Trainer.from_checkpoint", injected=2)
    calls = []
    for path in sorted((ROOT / "speechtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr == "load" and getattr(func.value, "id", None) == "torch":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("speechtrain/lightning/checkpoint.py:"), calls  # load_verified
    path = tmp_path / "model.ckpt"
    checkpoint.save_checkpoint({"state_dict": {"w": torch.arange(1000.0)}, "trainer_config": {}}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    from speechtrain.asr.conv_ctc import ConvCTCModel
    from speechtrain.lightning import Trainer

    with pytest.raises(checkpoint.CorruptCheckpointError, match="model.ckpt is corrupt"):
        ConvCTCModel(tiny_ctc_config()).init_from_pretrained(path)
    with pytest.raises(checkpoint.CorruptCheckpointError, match="model.ckpt is corrupt"):
        Trainer.from_checkpoint(path)
    record.survive(steps_lost=0)


# --------------------------------------------------------------------------------------- bounded reads
BOUNDED_READER = r"""
import json, os, resource, sys
from speechtrain.asr.nemo_import import read_members
from speechtrain.data.audio_text import unusable_reason
from speechtrain.data.nemo_adapters import LazyNeMoTarredIterator

def in_use():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))

limit = in_use() + (192 << 20)  # 192 MiB more address space than this interpreter holds once imported
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for case in json.loads(sys.argv[1]):
    os.environ.update(case.get("env", {}))
    try:
        if case["kind"] == "nemo":
            read_members(case["path"])
            print(json.dumps("read"))
        else:
            reader = LazyNeMoTarredIterator([case["manifest"]], [case["path"]], max_passes=1,
                                            max_member_bytes=case["max_member_bytes"])
            print(json.dumps([unusable_reason(cut) for cut in reader]))
    except MemoryError:
        print(json.dumps("MemoryError"))
    except Exception as error:
        print(json.dumps(f"{type(error).__name__}: {error}"))
    sys.stdout.flush()
"""


def _zeros_tar_gz(path: Path, members: dict[str, int]) -> Path:
    """A gzip tar of members of so many zero bytes (a few MB on disk for hundreds of MB inside)."""

    class Zeros(io.RawIOBase):
        def __init__(self, size):
            self.left = size

        def readable(self):
            return True

        def readinto(self, buffer):
            n = min(len(buffer), self.left)
            buffer[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, size in members.items():
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BufferedReader(Zeros(size)) if size else io.BytesIO())
    return path


def test_decompression_bombs_and_oversized_members_are_refused_in_bounded_memory(tmp_path, fault):
    record = fault("gzip bomb .nemo (one member / many), oversized tar shard member; address space capped", injected=3)
    mib = 1 << 20
    bomb = _zeros_tar_gz(tmp_path / "bomb.nemo", {"model_config.yaml": 0, "model_weights.ckpt": 256 * mib})
    many = _zeros_tar_gz(tmp_path / "many.nemo", {f"part{i}.bin": 40 * mib for i in range(6)})
    shard = _zeros_tar_gz(tmp_path / "audio_0.tar", {"big.wav": 256 * mib})
    manifest = tmp_path / "manifest_0.json"
    manifest.write_text(json.dumps({"audio_filepath": "big.wav", "duration": 1.0, "text": "1"}) + "\n")
    caps = {"SPEECHTRAIN_MAX_ARCHIVE_MEMBER_BYTES": str(64 * mib), "SPEECHTRAIN_MAX_ARCHIVE_BYTES": str(96 * mib)}
    cases = [
        {"kind": "nemo", "path": str(bomb), "env": caps},
        {"kind": "nemo", "path": str(many), "env": caps},
        {"kind": "shard", "path": str(shard), "manifest": str(manifest), "max_member_bytes": 64 * mib},
        # the control: with limits above the bomb, the capped child cannot hold it (the cap is real)
        {"kind": "nemo", "path": str(bomb), "env": {"SPEECHTRAIN_MAX_ARCHIVE_MEMBER_BYTES": str(1 << 30),
                                                    "SPEECHTRAIN_MAX_ARCHIVE_BYTES": str(1 << 30)}},
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", BOUNDED_READER, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    member, total, shard_cuts, control = (json.loads(line) for line in done.stdout.splitlines())
    assert member == (f"NemoImportError: {bomb}: member 'model_weights.ckpt' holds {256 * mib} bytes, over the limit "
                      f"of {64 * mib} bytes per member (SPEECHTRAIN_MAX_ARCHIVE_MEMBER_BYTES); refused.")  # fmt: skip
    assert total == (f"NemoImportError: {many}: more than {96 * mib} bytes once decompressed, over the limit per "
                     "archive (SPEECHTRAIN_MAX_ARCHIVE_BYTES); refused at member 'part2.bin'.")  # fmt: skip
    assert shard_cuts == [["oversized_audio", f"{shard}:big.wav: {256 * mib} bytes, over max_tar_member_bytes="
                                              f"{64 * mib}"]]  # fmt: skip
    assert control == "MemoryError"
    record.survive(steps_lost=0)


# ------------------------------------------------------------------------------- NeMo tarred shard faults
def _shard(tmp_path: Path, members: dict[str, bytes], listed: list[str], mode: str = "w") -> tuple[str, str]:
    tar_path = tmp_path / ("audio_0.tar.gz" if mode == "w:gz" else "audio_0.tar")
    with tarfile.open(tar_path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    manifest = tmp_path / "manifest_0.json"
    manifest.write_text("".join(json.dumps({"audio_filepath": n, "duration": 0.5, "text": "12"}) + "\n"
                                for n in listed))  # fmt: skip
    return str(manifest), str(tar_path)


def test_a_corrupt_and_a_missing_tar_member_are_skipped_and_counted(tmp_path, fault):
    record = fault("corrupt audio member and missing member in a NeMo tarred shard", injected=2)
    good = _wav(tmp_path / "a.wav", 0.5).read_bytes()
    manifest, tar = _shard(tmp_path, {"a.wav": good, "b.wav": b"RIFF\x00\x00\x00\x00not audio at all" * 10},
                           ["a.wav", "b.wav", "c.wav"])  # fmt: skip
    batches = _batches({"is_tarred": True, "manifest_filepath": manifest, "tarred_audio_filepaths": tar,
                        "batch_size": 3}, epoch_batches=1)  # fmt: skip
    (batch,) = batches
    assert len(batch["ids"]) == 1 and batch["audio_lens"].tolist() == [RATE // 2]
    summary = _summary(batches)
    assert summary.startswith("skipped 2 utterances: missing_audio=1 (e.g. ")
    assert f"{tar} has no member 'c.wav' ({manifest}:3)" in summary
    assert f"unreadable_audio=1 (e.g. {tar}:b.wav: " in summary
    record.survive(steps_lost=0)


def test_a_truncated_gzip_shard_yields_what_it_holds_and_counts_the_rest(tmp_path, fault):
    record = fault("truncated gzip NeMo tar shard")
    names = [f"u{i}.wav" for i in range(6)]
    members = {n: _wav(tmp_path / n, 0.5, seed=i).read_bytes() for i, n in enumerate(names)}  # noise: incompressible
    manifest, tar = _shard(tmp_path, members, names, mode="w:gz")
    data = Path(tar).read_bytes()
    Path(tar).write_bytes(data[: len(data) // 2])
    cuts = list(LazyNeMoTarredIterator([manifest], [tar], max_passes=1))
    read = [c for c in cuts if unusable_reason(c) is None]
    lost = [unusable_reason(c) for c in cuts if unusable_reason(c) is not None]
    assert 1 <= len(read) < 6 and len(read) + len(lost) == 6
    assert all(reason == "unreadable_audio" and f"{tar}: " in detail for reason, detail in lost)
    assert all(c.load_audio().shape == (1, RATE // 2) for c in read)
    record.survive(steps_lost=0)


# --------------------------------------------------------------------------------------- lying manifests
def test_audio_longer_than_its_manifest_says_is_read_up_to_the_stated_duration_and_counted(tmp_path, fault):
    record = fault("manifest duration lie (30 s of audio listed as 0.5 s)")
    liar, honest = _wav(tmp_path / "liar.wav", 30.0), _wav(tmp_path / "honest.wav", 2.0)
    manifest = tmp_path / "manifest.json"
    rows = [{"audio_filepath": str(liar), "duration": 0.5, "text": "12"},
            {"audio_filepath": str(honest), "duration": 1.5, "text": "34"}]  # fmt: skip
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    batches = _batches({"manifest_filepath": str(manifest), "duration_tolerance": 1.0})
    (batch,) = batches
    assert sorted(batch["audio_lens"].tolist()) == [RATE // 2, 2 * RATE]  # within the tolerance: read whole
    assert _summary(batches) == f"read in part 1 utterances: longer_than_manifest=1 (e.g. {liar})"
    record.survive(steps_lost=0)


@pytest.mark.slow  # (bad lines of a short manifest: counted and named by the tests below, default suite)
def test_a_bad_line_at_the_end_of_a_million_line_lazy_manifest_is_skipped_counted_and_named(tmp_path, fault):
    """The lazy reader's line loop over 1,000,000 lines (what LazyNeMoManifest turns into cuts, one per line; the
    next test follows bad lines through the loader into the skip summary)."""
    record = fault("non-UTF-8 line at the end of a 1,000,000-line lazy manifest")
    lines = 1_000_000
    manifest = tmp_path / "big.json"
    line = (json.dumps({"audio_filepath": "a.wav", "duration": 1.0, "text": "12"}) + "\n").encode()
    with open(manifest, "wb") as f:
        for _ in range(lines // 100_000):
            f.write(line * 100_000)
        f.write(b'{"audio_filepath": "a.wav", "duration": 1.0, "text": "\xff\xfe"}\n')
    count, last = 0, None
    for entry in iter_manifest_entries(manifest, skip_bad_lines=2):
        count, last = count + 1, entry
    assert count == lines + 1 and last == BadLine(lines + 1, last.problem)
    assert last.problem.startswith(f"{manifest}:{lines + 1}: not valid UTF-8")
    (cut,) = list(LazyNeMoManifest(_tail(manifest, tmp_path / "tail.json"), RATE, skip_bad_lines=2))[-1:]
    assert unusable_reason(cut)[0] == "bad_manifest_line"
    record.survive(steps_lost=0)


def _tail(path: Path, out: Path) -> Path:
    with open(path, "rb") as f:
        f.seek(-1000, os.SEEK_END)
        out.write_bytes(f.read().split(b"\n", 1)[1])
    return out


def test_bad_manifest_lines_are_counted_in_the_skip_summary_up_to_skip_bad_lines(tmp_path, dtmf_manifest):
    rows = [json.loads(r) for r in dtmf_manifest.read_text().splitlines()[:6]]
    rows = [json.dumps({**r, "audio_filepath": str(dtmf_manifest.parent / r["audio_filepath"])}) for r in rows]
    manifest = tmp_path / "manifest.json"
    manifest.write_text("\n".join([*rows[:3], "{not json", *rows[3:], '["a list"]']) + "\n")
    batches = _batches({"manifest_filepath": str(manifest), "skip_bad_lines": 2})
    assert sum(len(b["ids"]) for b in batches) == 6
    summary = _summary(batches)
    assert summary.startswith(f"skipped 2 utterances: bad_manifest_line=2 (e.g. {manifest}:4: invalid JSON")
    with pytest.raises(ManifestError, match=rf"{manifest}:8: expected a JSON object.*that is 2 bad lines in "
                                            rf"{manifest}, more than skip_bad_lines=1"):  # fmt: skip
        _batches({"manifest_filepath": str(manifest), "skip_bad_lines": 1})


def test_scan_manifests_names_bad_lines_at_start_and_refuses_too_many_before_any_batch(tmp_path, dtmf_manifest,
                                                                                        caplog):  # fmt: skip
    rows = [json.loads(r) for r in dtmf_manifest.read_text().splitlines()[:6]]
    rows = [json.dumps({**r, "audio_filepath": str(dtmf_manifest.parent / r["audio_filepath"])}) for r in rows]
    manifest = tmp_path / "manifest.json"
    manifest.write_text("\n".join([*rows, "{not json", '["a list"]']) + "\n")
    cfg = {"manifest_filepath": str(manifest), "scan_manifests": True, "batch_size": 4, "use_bucketing": False}
    dataset = AsrCutDataset.from_config(TOKENIZER, LoaderConfig(**cfg, skip_bad_lines=1))
    with pytest.raises(ManifestError, match=rf"{manifest}:8: .*more than skip_bad_lines=1"):
        get_lhotse_dataloader_from_config({**cfg, "skip_bad_lines": 1}, 0, 1, dataset)  # at build, not hours in
    with caplog.at_level(logging.INFO, logger="speechtrain.data.manifest"):
        get_lhotse_dataloader_from_config({**cfg, "skip_bad_lines": 2}, 0, 1, dataset)
    assert f"Scanned {manifest}: 6 entries, 2 bad lines" in caplog.text
    assert f"{manifest}:7: invalid JSON" in caplog.text


# ------------------------------------------------------------------------------------------ cache keys
def _edit_in_place(path: Path, old: str, new: str) -> None:
    """Rewrite ``path`` with ``old`` replaced by ``new`` (same length), keeping its size and modification time."""
    assert len(old) == len(new)
    stat = path.stat()
    path.write_text(path.read_text().replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size


def test_a_manifest_edited_in_place_to_the_same_size_rebuilds_the_tokenizer_and_the_codec(tmp_path, dtmf_manifest,
                                                                                          fault):  # fmt: skip
    from speechtrain.asr.ctc import TokenizerConfig
    from speechtrain.asr.jobs import ensure_tokenizer
    from speechtrain.common.tokenizers import load_tokenizer
    from speechtrain.tts.codec import MelRVQCodecConfig, ensure_codec

    record = fault("manifest edited in place, same size and mtime (tokenizer and codec caches)", injected=2)
    manifest = tmp_path / "manifest.json"
    rows = [json.loads(r) for r in dtmf_manifest.read_text().splitlines()[:40]]
    manifest.write_text("".join(json.dumps({**r, "audio_filepath": str(dtmf_manifest.parent / r["audio_filepath"]),
                                            "text": f"{r['text']} one two"}) + "\n" for r in rows))  # fmt: skip
    first = TokenizerConfig(type="bpe", vocab_size=24)
    ensure_tokenizer(first, str(manifest))
    codec_cfg = MelRVQCodecConfig(num_codebooks=1, codebook_size=4, kmeans_iterations=1, n_mels=16)
    codec = ensure_codec(codec_cfg, str(manifest), max_utterances=4)
    _edit_in_place(manifest, "one two", "six ten")
    second = TokenizerConfig(type="bpe", vocab_size=24)
    ensure_tokenizer(second, str(manifest))
    assert second.path != first.path
    assert "s" in "".join(load_tokenizer(second.path).vocab) and "s" not in "".join(load_tokenizer(first.path).vocab)
    assert ensure_codec(codec_cfg, str(manifest), max_utterances=4) != codec
    record.survive(steps_lost=0)

import json
import re

import pytest

from speechtrain.data.manifest import MAX_LINE_BYTES, ManifestError, read_nemo_manifest


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _record(**fields):
    record = {"audio_filepath": "a.wav", "duration": 1.5, "text": "hi"}
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def test_reads_records_resolving_paths(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    manifest = _write(
        folder / "manifest.json",
        [
            _record(audio_filepath="audio/a.wav", speaker="s1"),
            "",
            "   ",
            _record(audio_filepath="/abs/b.wav", duration=2, text="", offset=0.25),
        ],
    )
    records = read_nemo_manifest(manifest)
    assert records == [
        {
            "audio_filepath": str(folder / "audio" / "a.wav"),
            "duration": 1.5,
            "text": "hi",
            "speaker": "s1",
            "offset": 0.0,
        },
        {"audio_filepath": "/abs/b.wav", "duration": 2.0, "text": "", "offset": 0.25},
    ]
    assert isinstance(records[1]["duration"], float)


def test_accepts_str_path_bom_and_crlf(tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_bytes(b"\xef\xbb\xbf" + _record().encode() + b"\r\n" + _record(text="yo").encode() + b"\r\n")
    assert [r["text"] for r in read_nemo_manifest(str(manifest))] == ["hi", "yo"]


def test_empty_manifest_gives_no_records(tmp_path):
    assert read_nemo_manifest(_write(tmp_path / "m.json", [])) == []


def test_missing_manifest_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.json"))):
        read_nemo_manifest(tmp_path / "nope.json")


def _error(manifest):
    with pytest.raises(ManifestError) as info:
        read_nemo_manifest(manifest)
    return str(info.value)


def test_invalid_json_names_file_and_line(tmp_path):
    manifest = _write(tmp_path / "m.json", [_record(), "", '{"audio_filepath": "a.wav", "duration": 1,'])
    message = _error(manifest)
    assert message.startswith(f"{manifest}:3: invalid JSON")
    assert "Expecting" in message  # the JSON parser's own explanation


@pytest.mark.parametrize("key", ["audio_filepath", "duration", "text"])
def test_missing_key_names_file_line_and_key(tmp_path, key):
    manifest = _write(tmp_path / "m.json", [_record(), _record(**{key: ...})])
    message = _error(manifest)
    assert message.startswith(f"{manifest}:2:")
    assert f"missing required key '{key}'" in message


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (_record(duration=-0.1), "duration"),
        (_record(duration="1.0"), "duration"),
        (_record(duration=True), "duration"),
        (_record(duration=None), "duration"),
        ('{"audio_filepath": "a.wav", "duration": NaN, "text": ""}', "duration"),
        ('{"audio_filepath": "a.wav", "duration": Infinity, "text": ""}', "duration"),
        (_record(text=None), "text"),
        (_record(text=3), "text"),
        (_record(audio_filepath=""), "audio_filepath"),
        (_record(audio_filepath=["a.wav"]), "audio_filepath"),
        (_record(offset=-1), "offset"),
        (_record(offset="0"), "offset"),
    ],
)
def test_invalid_values_name_the_field(tmp_path, line, field):
    manifest = _write(tmp_path / "m.json", [line])
    message = _error(manifest)
    assert message.startswith(f"{manifest}:1:")
    assert f"'{field}'" in message


@pytest.mark.parametrize("line", ["[1, 2]", '"text"', "3"])
def test_non_object_lines_are_rejected(tmp_path, line):
    manifest = _write(tmp_path / "m.json", [_record(), line])
    assert _error(manifest).startswith(f"{manifest}:2: expected a JSON object")


def test_invalid_utf8_is_rejected(tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_bytes(_record().encode() + b"\n" + b'{"text": "\xff"}\n')
    assert _error(manifest).startswith(f"{manifest}:2: not valid UTF-8")


def test_overlong_line_is_rejected(tmp_path):
    manifest = _write(tmp_path / "m.json", [_record(), _record(text="x" * (MAX_LINE_BYTES + 10)), _record()])
    message = _error(manifest)
    assert message.startswith(f"{manifest}:2:")
    assert "longer than" in message


def test_line_at_the_limit_is_accepted(tmp_path):
    line = _record(text="")
    line = line.replace('"text": ""', '"text": "' + "y" * (MAX_LINE_BYTES - len(line)) + '"')
    assert len(line.encode()) == MAX_LINE_BYTES
    manifest = _write(tmp_path / "m.json", [line, _record()])
    assert len(read_nemo_manifest(manifest)) == 2


def test_manifest_error_is_a_value_error():
    assert issubclass(ManifestError, ValueError)

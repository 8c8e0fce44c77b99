"""Print an ``input_cfg`` blend whose weights follow the sources' sizes, flattened or sharpened by a temperature.

    python -m speechtrain.datatools.blend_weights en.json de.json cuts.jsonl.gz shar_dir/ --temperature 2

Each source's size is its hours of audio, read from metadata only (no audio is opened): a NeMo manifest (any other
file), a lhotse cuts file (``.jsonl``/``.jsonl.gz``) or a lhotse Shar folder (its ``cuts.*.jsonl.gz``). Source i
gets weight ``w_i ∝ hours_i ** (1 / T)``, normalised to sum 1:

- ``T = 1``: proportional to size (every utterance is equally likely to be drawn, as when concatenating);
- ``T > 1``: flatter, small sources are drawn more often than their size says (``T -> inf``: uniform);
- ``T < 1``: sharper, the large sources dominate (``T = 0.5`` squares the sizes).

The output is YAML to paste under a dataset node (``train_ds``), with one comment per source giving its hours::

    input_cfg:
      # en.json: 812.4 h
      - type: nemo
        manifest_filepath: en.json
        weight: 0.6717

Python API: :func:`temperature_weights` (sizes -> weights) and :func:`estimate_blend` (paths -> ``input_cfg``).
"""

import argparse
import math
import sys
from pathlib import Path
from typing import Any

# The path key of each source type in an ``input_cfg`` entry (see speechtrain.data.lhotse_loader.blend_sources).
PATH_KEYS = {"nemo": "manifest_filepath", "lhotse": "cuts_path", "lhotse_shar": "shar_path"}


def temperature_weights(sizes: list[float], temperature: float) -> list[float]:
    """Blend weights ``w_i ∝ sizes_i ** (1 / temperature)``, normalised to sum 1.

    Args:
        sizes: Size of each source (e.g. hours), each a finite number > 0.
        temperature: Finite number > 0; 1 is proportional to size, larger is flatter, smaller is sharper.

    Raises:
        ValueError: On an empty ``sizes``, a size that is not a finite positive number, or a temperature that
            is not a finite positive number.
    """
    if len(sizes) == 0:
        raise ValueError("sizes is empty: give the size of at least one source.")
    for index, size in enumerate(sizes):
        if not (isinstance(size, int | float) and math.isfinite(size) and size > 0):
            raise ValueError(f"sizes[{index}] must be a finite number > 0, got {size!r}.")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}.")
    # In log space: sizes ** (1 / T) overflows for small T and hours in the thousands.
    logs = [math.log(size) / temperature for size in sizes]
    top = max(logs)
    powers = [math.exp(value - top) for value in logs]
    total = sum(powers)
    return [p / total for p in powers]


def source_entry(path: str | Path) -> dict[str, Any]:
    """The ``input_cfg`` entry (``type`` and path key) for a path: a folder is lhotse Shar, a ``.jsonl``/``.jsonl.gz``
    file is lhotse cuts, any other file a NeMo manifest."""
    path = str(path)
    if Path(path).is_dir():
        kind = "lhotse_shar"
    elif path.endswith((".jsonl", ".jsonl.gz")):
        kind = "lhotse"
    else:
        kind = "nemo"
    return {"type": kind, PATH_KEYS[kind]: path}


def source_hours(entry: dict[str, Any]) -> float:
    """Hours of audio of an ``input_cfg`` source (``nemo``, ``lhotse`` or ``lhotse_shar``), from metadata only."""
    from lhotse import CutSet

    from speechtrain.data.manifest import read_nemo_manifest

    kind = entry["type"]
    if kind == "nemo":
        return sum(r["duration"] for r in read_nemo_manifest(entry["manifest_filepath"])) / 3600
    if kind == "lhotse":
        path = Path(entry["cuts_path"])
        if not path.is_file():
            raise FileNotFoundError(f"cuts file not found: {path}")
        files = [path]
    elif kind == "lhotse_shar":
        # The per-shard cuts manifests hold the durations; the audio tars are not opened.
        files = sorted(Path(entry["shar_path"]).glob("cuts.*jsonl*"))
        if not files:
            raise FileNotFoundError(f"{entry['shar_path']} holds no cuts.*.jsonl.gz: it is not a lhotse Shar folder.")
    else:
        raise ValueError(f"Cannot size a source of type {kind!r}; expected one of {', '.join(PATH_KEYS)}.")
    return sum(cut.duration for f in files for cut in CutSet.from_jsonl_lazy(f)) / 3600


def _blend(inputs: list[str | Path], temperature: float) -> tuple[list[dict[str, Any]], list[float]]:
    if not inputs:
        raise ValueError("No inputs: give at least one manifest, cuts file or Shar folder.")
    entries = [source_entry(p) for p in inputs]
    hours = [source_hours(e) for e in entries]
    for path, h in zip(inputs, hours):
        if h <= 0:
            raise ValueError(f"{path} holds no audio (0 hours); remove it from the blend.")
    weights = temperature_weights(hours, temperature)
    return [{**e, "weight": w} for e, w in zip(entries, weights)], hours


def estimate_blend(inputs: list[str | Path], temperature: float) -> list[dict[str, Any]]:
    """An ``input_cfg`` list for ``inputs`` with temperature-scaled weights (see module docstring).

    Args:
        inputs: NeMo manifests, lhotse cuts files (``.jsonl``/``.jsonl.gz``) and/or lhotse Shar folders.
        temperature: See :func:`temperature_weights`.

    Returns:
        One entry per input, in order: ``{"type", <path key>: path, "weight"}``, weights summing to 1, ready for
        :func:`speechtrain.data.lhotse_loader.blend_sources`.
    """
    return _blend(inputs, temperature)[0]


def _yaml_weight(weight: float) -> float:
    # 4 decimals, but never 0: blend_sources rejects a zero weight, and a tiny source is still a source.
    return round(weight, 4) or float(f"{weight:.3g}")


def format_input_cfg(entries: list[dict[str, Any]], hours: list[float], temperature: float) -> str:
    """YAML for ``entries`` (as from :func:`estimate_blend`) with a comment giving each source's hours."""
    import yaml

    lines = [f"# weights proportional to hours ** (1 / {temperature:g}); {sum(hours):.4g} h in all", "input_cfg:"]
    for entry, h in zip(entries, hours):
        lines.append(f"  # {entry[PATH_KEYS[entry['type']]]}: {h:.4g} h")
        item = {**entry, "weight": _yaml_weight(entry["weight"])}
        text = yaml.safe_dump([item], sort_keys=False, allow_unicode=True, width=1000)
        lines += [f"  {line}" for line in text.splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m speechtrain.datatools.blend_weights", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("inputs", nargs="+", help="NeMo manifests, lhotse cuts (.jsonl[.gz]) and/or Shar folders")
    parser.add_argument("-t", "--temperature", type=float, default=1.0, help="1: proportional; >1 flatter; <1 sharper")
    args = parser.parse_args(argv)
    try:
        entries, hours = _blend(args.inputs, args.temperature)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(format_input_cfg(entries, hours, args.temperature))


if __name__ == "__main__":
    main()

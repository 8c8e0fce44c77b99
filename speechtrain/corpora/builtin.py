"""Built-in corpus names (``builtin:<corpus>/<split>``), resolved to manifests that are built on first use.

Command line (build or reuse a corpus, or resolve names)::

    python -m speechtrain.corpora.builtin --hours 2 [--out DIR] [--seed 0] [--workers 2]
    python -m speechtrain.corpora.builtin --hours 10 --engines espeak=3,piper=1,festival=1  # another mix
    python -m speechtrain.corpora.builtin builtin:speech/train builtin:speech/dev  # prints their manifests
"""

import argparse
import json
import logging
import os
import re
import time
from pathlib import Path

from speechtrain.corpora import dtmf
from speechtrain.corpora.speech_corpus import (
    EXTRA_SPLIT,
    HELDOUT_ENGINE,
    HELDOUT_SPLITS,
    SPEECH_EXTRA,
    SPLITS,
    TTS_VOICE,
    build_corpus,
    build_speech_corpus,
    build_speech_extra,
)

BUILTIN_PREFIX = f"builtin:{dtmf.CORPUS_NAME}/"
ESPEAK_DEFAULT_HOURS = 20.0  # builtin:espeak, hours planned over its three splits
ESPEAK_TTS_DEFAULT_HOURS = 6.0  # the single-voice TTS corpus
SPEECH_DEFAULT_HOURS = 10.0  # the multi-engine demo corpus


def resolve_manifest(manifest_filepath: str | os.PathLike) -> Path:
    """A manifest path, with built-in corpus names resolved (the corpus is built on first use, then cached).

    - ``builtin:dtmf/<train|val>``: the DTMF-digit corpus;
    - ``builtin:espeak/<train|dev|test>``: the eSpeak NG speech corpus (20 h planned, seed 0);
      ``builtin:espeak-<H>h/<split>`` or ``builtin:espeak-<H>h-seed<S>/<split>`` for another size or seed;
    - ``builtin:espeak-tts/<split>``: the same sentences read by one voice at one rate and pitch (6 h), for TTS;
      ``builtin:espeak-tts-<H>h[-seed<S>]/<split>`` for another size or seed;
    - ``builtin:speech/<train|dev|test|heldout_engine|heldout_engine_train>``: the multi-engine corpus (eSpeak NG,
      Piper and Festival mixed 4:3:3, Flite held out; 10 h planned, seed 0);
      ``builtin:speech-<H>h[-seed<S>]/<split>`` for another size or seed
      (see :mod:`speechtrain.corpora.speech_corpus`);
      ``builtin:speech/train_extra``: more training speech on sentences no other split reads (eSpeak NG, 12 h
      planned), built beside the corpus; ``train_extra-espeak6h-piper1h`` for other engines and hours;
    - ``builtin:<corpus>/<split>@<engine>[+<engine>...]``: only those engines' utterances of the split (e.g.
      ``builtin:speech/train@piper+festival``), to weight engines in an ``input_cfg`` blend.
    """
    name = str(manifest_filepath)
    if not name.startswith("builtin:"):
        return Path(name)
    corpus, _, split = name[len("builtin:") :].partition("/")
    split, at, engines = split.partition("@")
    if at:  # one engine's (or several engines') utterances of a built-in split: a filtered copy of its manifest
        return engine_view(resolve_manifest(f"builtin:{corpus}/{split}"), engines.split("+"), name)
    if corpus == dtmf.CORPUS_NAME and split in dtmf.DEFAULT_SPLITS:
        return dtmf.prepare_dtmf_corpus()[split]
    if corpus == "speech" or corpus.startswith("speech-"):
        hours, seed = _espeak_params("espeak" + corpus[len("speech") :])
        if corpus == "speech":
            hours = SPEECH_DEFAULT_HOURS
        extra = _extra_params(split)
        if hours is not None and extra is not None:
            return Path(build_speech_extra(extra, hours=hours, seed=seed)["splits"]["train_extra"]["manifest"])
        if hours is not None and (split in SPLITS or split in HELDOUT_SPLITS):
            return Path(build_speech_corpus(hours=hours, seed=seed)["splits"][split]["manifest"])
    if corpus.startswith("espeak"):
        single_voice = corpus == "espeak-tts" or corpus.startswith("espeak-tts-")
        if single_voice:
            corpus = "espeak" + corpus[len("espeak-tts") :]
        hours, seed = _espeak_params(corpus)
        if single_voice and corpus == "espeak":
            hours = ESPEAK_TTS_DEFAULT_HOURS
        if hours is not None and split in SPLITS:
            record = build_corpus(hours=hours, seed=seed, voice=TTS_VOICE if single_voice else None)
            return Path(record["splits"][split]["manifest"])
    choices = [f"{BUILTIN_PREFIX}{s}" for s in dtmf.DEFAULT_SPLITS] + [
        "builtin:espeak/train|dev|test",
        "builtin:espeak-<H>h[-seed<S>]/train|dev|test",
        "builtin:espeak-tts[-<H>h][-seed<S>]/train|dev|test",
        "builtin:speech[-<H>h][-seed<S>]/train|dev|test|heldout_engine|heldout_engine_train",
        "builtin:speech[-<H>h][-seed<S>]/train_extra[-<engine><H>h...]",
    ]
    raise ValueError(f"Unknown built-in corpus {name!r}; choose one of: {', '.join(choices)}.")


def engine_view(manifest: Path, engines: list[str], name: str) -> Path:
    """The utterances of ``manifest`` read by one of ``engines`` (its rows' ``engine``; eSpeak NG when a row has
    none), as a manifest beside it (``manifest.<engines>.json``, written once; relative audio paths still hold)."""
    if not all(engines):
        raise ValueError(f"{name}: name the engines after '@', joined by '+' (e.g. @piper+festival).")
    out = manifest.with_name(f"{manifest.stem}.{'+'.join(engines)}.json")
    if out.is_file() and out.stat().st_mtime >= manifest.stat().st_mtime:
        return out
    kept = 0
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    with open(manifest, encoding="utf-8") as rows, open(tmp, "w", encoding="utf-8") as view:
        for line in rows:
            if line.strip() and json.loads(line).get("engine", "espeak") in engines:
                view.write(line if line.endswith("\n") else line + "\n")
                kept += 1
    if kept == 0:
        tmp.unlink()
        with open(manifest, encoding="utf-8") as rows:
            found = sorted({json.loads(line).get("engine", "espeak") for line in rows if line.strip()})
        raise ValueError(f"{name}: no utterance of {manifest} is read by {'+'.join(engines)}; its engines: {found}.")
    os.replace(tmp, out)
    return out


def _extra_params(split: str) -> dict[str, float] | None:
    """``train_extra`` -> the default extra hours; ``train_extra-espeak12h-piper1.5h`` -> {espeak: 12, piper: 1.5};
    any other split -> None."""
    if split == EXTRA_SPLIT:
        return dict(SPEECH_EXTRA)
    if not split.startswith(EXTRA_SPLIT + "-"):
        return None
    parts = split[len(EXTRA_SPLIT) + 1 :].split("-")
    matches = [re.fullmatch(r"([a-z]+)(\d+(?:\.\d+)?)h", part) for part in parts]
    if not all(matches):
        return None
    return {m.group(1): float(m.group(2)) for m in matches}


def _espeak_params(corpus: str) -> tuple[float | None, int]:
    """``espeak`` -> (10.0, 0); ``espeak-20h`` -> (20.0, 0); ``espeak-2h-seed3`` -> (2.0, 3); else (None, 0)."""
    if corpus == "espeak":
        return ESPEAK_DEFAULT_HOURS, 0
    match = re.fullmatch(r"espeak-(\d+(?:\.\d+)?)h(?:-seed(\d+))?", corpus)
    if match is None:
        return None, 0
    return float(match.group(1)), int(match.group(2) or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m speechtrain.corpora.builtin", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="corpus folder (default: in SPEECHTRAIN_DATASETS_CACHE)")
    parser.add_argument("--hours", type=float, default=1.0, help="approximate hours of speech")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="synthesis processes (default: usable CPUs)")
    parser.add_argument("--utterances", type=int, help="an exact number of utterances instead of --hours")
    parser.add_argument("--voice", help=f"one voice for all utterances (a TTS corpus), e.g. {TTS_VOICE}")
    parser.add_argument(
        "--engines", help="the multi-engine corpus with these weights, e.g. espeak=3,piper=1,festival=1"
    )
    parser.add_argument("--heldout", default=HELDOUT_ENGINE, help="multi-engine corpus: the held-out synthesiser")
    names_help = "instead: built-in manifest names to build or reuse (builtin:speech/train ...); prints their files"
    parser.add_argument("names", nargs="*", help=names_help)
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")  # the synthesis's progress lines
    if args.names:  # what `make demo` builds before it sets the training budget
        start = time.perf_counter()
        for name in args.names:
            print(f"{name}: {resolve_manifest(name)}", flush=True)
        print(f"ready in {time.perf_counter() - start:.0f} s")
        return
    if args.engines:
        engines = {k: float(v) for k, _, v in (item.partition("=") for item in args.engines.split(","))}
        heldout = None if args.heldout in ("", "none", "null") else args.heldout
        record = build_speech_corpus(args.out, args.hours, args.seed, args.workers, engines, heldout)
    else:
        record = build_corpus(args.out, args.hours, args.seed, args.workers, args.utterances, args.voice)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()

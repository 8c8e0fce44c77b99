"""Accuracy and generation speed of a SALM archive on a test manifest, for every task it was trained on.

    python benchmarks/salm_eval.py --model salm_demo.stm [--manifest builtin:espeak/test] [--utterances 200] \
        [--batch-size 16] [--no-cache-utterances 48]

Prints one JSON line per task (WER for transcription, exact-match accuracy for every task, answers per second)
and one line comparing generation with Megatron's static KV cache against recomputing the whole sequence at
every step (same answers; the time per answer token).
"""

import argparse
import json
import time

import torch
from omegaconf import OmegaConf

from speechtrain.core.model import SpeechModel
from speechtrain.speechlm.backbone import ensure_parallel_state
from speechtrain.speechlm.generate import _manifest_cuts, answer_cuts, score


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--manifest", default="builtin:espeak/test")
    parser.add_argument("--utterances", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--no-cache-utterances", type=int, default=48)
    args = parser.parse_args(argv)
    ensure_parallel_state()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = SpeechModel.restore_from(args.model).eval()
    cuts = _manifest_cuts(args.manifest, model.cfg.sample_rate, args.utterances)
    print(json.dumps({"model": args.model, "parameters": sum(p.numel() for p in model.parameters()),
                      "utterances": len(cuts), "threads": torch.get_num_threads()}))  # fmt: skip
    tasks = [OmegaConf.to_object(t) for t in model.cfg.tasks]
    for task in tasks:
        start = time.perf_counter()
        rows = answer_cuts(model, cuts, task, args.batch_size)
        seconds = time.perf_counter() - start
        result = {k: round(v, 4) for k, v in score(rows, task).items()}
        print(json.dumps({"task": task.name, **result, "seconds": round(seconds, 1),
                          "answers_per_s": round(len(rows) / seconds, 2)}))  # fmt: skip
    subset = _manifest_cuts(args.manifest, model.cfg.sample_rate, args.no_cache_utterances)
    timings = {}
    answers = {}
    for use_cache in (True, False):
        start = time.perf_counter()
        rows = answer_cuts(model, subset, tasks[0], args.batch_size, use_cache=use_cache)
        timings[use_cache] = time.perf_counter() - start
        answers[use_cache] = [r["answer"] for r in rows]
    tokens = sum(len(model.tokenizer.encode(a)) + 1 for a in answers[True])
    print(json.dumps({"kv_cache": {"utterances": len(answers[True]), "same_answers": answers[True] == answers[False],
                                   "ms_per_token_cached": round(1000 * timings[True] / tokens, 2),
                                   "ms_per_token_recomputed": round(1000 * timings[False] / tokens, 2),
                                   "speedup": round(timings[False] / timings[True], 2)}}))  # fmt: skip


if __name__ == "__main__":
    main()

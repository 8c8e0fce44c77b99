"""The per-step timing hooks of ``benchmarks/dp_step_balance.py``: that script puts this folder on ``PYTHONPATH`` so
that every process of its training run (the ranks Lightning starts run ``examples/asr_train.py`` afresh) imports this
module at start-up. With ``SPEECHTRAIN_DP_BALANCE_DIR`` set it wraps the engine's step, its gradient finalisation
(the data-parallel all-reduce) and the optimizer's update, and appends one line per training step to
``<dir>/rank<r>.txt``: batch size, longest utterance (samples), longest transcript (tokens), forward + backward (s),
all-reduce (s), the rest of the optimizer step (s), the step's end (``perf_counter``). Without the variable it does
nothing."""

import os
import time

if os.environ.get("SPEECHTRAIN_DP_BALANCE_DIR"):
    import torch

    from speechtrain.lightning import megatron_parallel, optimizer

    _ENGINE, _OPTIMIZER = megatron_parallel.MegatronParallel, optimizer.MegatronOptimizer
    _run, _finalize, _step = _ENGINE.run, _ENGINE._finalize, _OPTIMIZER.step
    _state: dict = {}

    def _now() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # measurement only: the step's own code has no such sync
        return time.perf_counter()

    def _file():
        if "file" not in _state:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            folder = os.environ["SPEECHTRAIN_DP_BALANCE_DIR"]
            _state["file"] = open(os.path.join(folder, f"rank{rank}.txt"), "w")  # noqa: SIM115 (open for the run)
        return _state["file"]

    def run(self, batch, forward_only, last_in_window=True):
        if not forward_only and isinstance(batch, dict) and "audio_lens" in batch:
            tokens = batch.get("token_lens")
            longest_tokens = int(tokens.max()) if tokens is not None else 0
            _state["shape"] = (len(batch["audio_lens"]), int(batch["audio_lens"].max()), longest_tokens)
            _state["start"] = _now()
        return _run(self, batch, forward_only, last_in_window)

    def finalize(self, model, num_tokens, **kwargs):
        start = _now()
        result = _finalize(self, model, num_tokens, **kwargs)
        _state["reduced_at"] = _now()
        _state["reduce"] = (start - _state.pop("start", start), _state["reduced_at"] - start)
        return result

    def step(self, closure=None):
        result = _step(self, closure)
        if "reduce" in _state and "shape" in _state:
            end = _now()
            n, frames, tokens = _state.pop("shape")
            compute, reduce = _state.pop("reduce")
            update = end - _state.pop("reduced_at")
            record = _file()
            record.write(f"{n} {frames} {tokens} {compute:.5f} {reduce:.5f} {update:.5f} {end:.5f}\n")
            record.flush()
        return result

    _ENGINE.run, _ENGINE._finalize, _OPTIMIZER.step = run, finalize, step

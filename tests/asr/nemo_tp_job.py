"""Fine-tuning start from a ``.nemo`` under tensor parallelism; launched by test_asr_nemo.py with torchrun (gloo).

As in examples/asr_finetune.py, the pretrained model is restored before the parallel layout exists (full weights);
the fine-tuning model is built under TP and each rank takes its slices. Rank 0 writes ``<out>`` (JSON): the TP
size, the number of sliced parameters and the largest difference of the model's log-probs from NeMo's (for a
transducer, of its joint's logits on the fixture's labels).

    torchrun --nproc_per_node=2 tests/asr/nemo_tp_job.py tests/fixtures/nemo/conformer_ctc.nemo out.json
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import soundfile as sf
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from speechtrain.core.model import SpeechModel
from speechtrain.lightning.megatron_compat import import_megatron

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def main() -> None:
    nemo, out = Path(sys.argv[1]), Path(sys.argv[2])
    base = SpeechModel.restore_from(nemo)
    dist.init_process_group("gloo")
    import_megatron()
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]))
    spec = importlib.util.spec_from_file_location("asr_finetune", EXAMPLES / "asr_finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    model = finetune.finetune_model(base, {}, defer=True)
    model.configure_model()
    model.eval()
    sharded = sum(bool(getattr(p, "tensor_model_parallel", False)) for p in model.parameters())

    waves = [torch.from_numpy(sf.read(nemo.parent / f"input_{c}.wav", dtype="float32")[0]) for c in "ab"]
    lengths = torch.tensor([len(w) for w in waves])
    audio = torch.zeros(len(waves), int(lengths.max()))
    for i, wave in enumerate(waves):
        audio[i, : len(wave)] = wave
    expected = load_file(nemo.with_name(nemo.stem + ".expected.safetensors"))
    key = "joint_logits" if hasattr(model, "joint") else "log_probs"
    with torch.no_grad():
        outputs, out_lengths = model(audio, lengths)
        if key == "joint_logits":  # the encoder's output (whole on every rank) through the replicated joint
            pred = model.prediction(expected["labels"])
            outputs = model.joint(model.joint.enc_proj(outputs)[:, :, None], model.joint.pred_proj(pred)[:, None])
    assert out_lengths.tolist() == expected["lengths"].tolist()
    diff = max((outputs[i, :n] - expected[key][i, :n]).abs().max().item()
               for i, n in enumerate(out_lengths.tolist()))  # fmt: skip
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"tp": mpu.get_tensor_model_parallel_world_size(), "sharded": sharded,
                                   "max_difference": diff}))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Check with NeMo itself that our ``.nemo`` exports load in NeMo and give NeMo's log-probs on the fixtures.

Needs NeMo (``pip install nemo-toolkit[asr]``, in its own environment). First export each fixture through
speechtrain (import, then export), in speechtrain's environment::

    for f in tests/fixtures/nemo/*.nemo; do python -m speechtrain.asr.export_nemo $f exported/$(basename $f); done

then, in NeMo's environment::

    python tools/check_nemo_export.py exported/*.nemo

For each file, NeMo's ``ASRModel.restore_from`` runs it in eval mode on the fixture batch and the largest
difference from ``tests/fixtures/nemo/<name>.expected.safetensors`` (NeMo's outputs of the original model) over
the valid frames is printed: the CTC log-probs, and for a transducer the joint's raw logits on the fixture's labels
and whether NeMo's greedy hypotheses of the fixture's encoder output are the original's. The exit status is 1 when
a difference exceeds ``--tolerance`` or a hypothesis differs.
"""

import argparse
import sys
from pathlib import Path

import soundfile as sf
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nemo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exported", nargs="+", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    import nemo
    from nemo.collections.asr.models import ASRModel

    waves = [torch.from_numpy(sf.read(FIXTURES / f"input_{c}.wav", dtype="float32")[0]) for c in "ab"]
    lengths = torch.tensor([len(w) for w in waves])
    audio = torch.zeros(len(waves), int(lengths.max()))
    for i, wave in enumerate(waves):
        audio[i, : len(wave)] = wave
    worst, same = 0.0, True
    for path in args.exported:
        model = ASRModel.restore_from(str(path), map_location="cpu").eval()
        expected = load_file(FIXTURES / f"{path.stem}.expected.safetensors")
        with torch.no_grad():
            if hasattr(model, "joint"):
                encoded, out_lengths = model.forward(input_signal=audio, input_signal_length=lengths)
                outputs = {}
                if "log_probs" in expected:  # a hybrid's CTC head
                    outputs["log-prob"] = model.ctc_decoder(encoder_output=encoded)
                pred, _ = model.decoder.predict(expected["labels"], state=None, add_sos=True, batch_size=2)
                model.joint.log_softmax = False
                outputs["joint logit"] = model.joint.joint(encoded.transpose(1, 2), pred)
                model.joint.log_softmax = None
                frames = expected["greedy_input"].transpose(1, 2)
                hypotheses = model.decoding.rnnt_decoder_predictions_tensor(
                    encoder_output=frames, encoded_lengths=expected["greedy_lengths"]
                )
                greedy = all(h.y_sequence.tolist() == expected[f"greedy_{i}"].tolist()
                             for i, h in enumerate(hypotheses))  # fmt: skip
            else:
                log_probs, out_lengths, _ = model.forward(input_signal=audio, input_signal_length=lengths)
                outputs, greedy = {"log-prob": log_probs}, True
        assert out_lengths.tolist() == expected["lengths"].tolist(), (path, out_lengths, expected["lengths"])
        keys = {"log-prob": "log_probs", "joint logit": "joint_logits"}
        for what, tensor in outputs.items():
            diff = max((tensor[i, :n] - expected[keys[what]][i, :n]).abs().max().item()
                       for i, n in enumerate(out_lengths.tolist()))  # fmt: skip
            worst = max(worst, diff)
            print(f"NeMo {nemo.__version__} restore_from({path}): {type(model).__name__}, max |{what} difference| = "
                  f"{diff:.2e}")  # fmt: skip
        if hasattr(model, "joint"):
            print(f"  greedy hypotheses of the fixture's encoder output: {'the same' if greedy else 'DIFFERENT'}")
        same = same and greedy
    sys.exit(1 if worst > args.tolerance or not same else 0)


if __name__ == "__main__":
    main()

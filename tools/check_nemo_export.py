"""Check with NeMo itself that our ``.nemo`` exports load in NeMo and give NeMo's log-probs on the fixtures.

Needs NeMo (``pip install nemo-toolkit[asr]``, in its own environment). First export each fixture through
speechtrain (import, then export), in speechtrain's environment::

    for f in tests/fixtures/nemo/*.nemo; do python -m speechtrain.asr.export_nemo $f exported/$(basename $f); done

then, in NeMo's environment::

    python tools/check_nemo_export.py exported/*.nemo

For each file, ``EncDecCTCModelBPE.restore_from`` runs it in eval mode on the fixture batch and the largest
difference from ``tests/fixtures/nemo/<name>.expected.safetensors`` (NeMo's log-probs of the original model) over
the valid frames is printed; the exit status is 1 when any exceeds ``--tolerance``.
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
    from nemo.collections.asr.models import EncDecCTCModelBPE

    waves = [torch.from_numpy(sf.read(FIXTURES / f"input_{c}.wav", dtype="float32")[0]) for c in "ab"]
    lengths = torch.tensor([len(w) for w in waves])
    audio = torch.zeros(len(waves), int(lengths.max()))
    for i, wave in enumerate(waves):
        audio[i, : len(wave)] = wave
    worst = 0.0
    for path in args.exported:
        model = EncDecCTCModelBPE.restore_from(str(path), map_location="cpu").eval()
        with torch.no_grad():
            log_probs, out_lengths, _ = model.forward(input_signal=audio, input_signal_length=lengths)
        expected = load_file(FIXTURES / f"{path.stem}.expected.safetensors")
        assert out_lengths.tolist() == expected["lengths"].tolist(), (path, out_lengths, expected["lengths"])
        diff = max((log_probs[i, :n] - expected["log_probs"][i, :n]).abs().max().item()
                   for i, n in enumerate(out_lengths.tolist()))  # fmt: skip
        worst = max(worst, diff)
        print(f"NeMo {nemo.__version__} restore_from({path}): max |log-prob difference| = {diff:.2e}")
    sys.exit(1 if worst > args.tolerance else 0)


if __name__ == "__main__":
    main()

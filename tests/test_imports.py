"""Imports are light and quiet: checked in fresh interpreters, with warnings turned into errors."""

import subprocess
import sys


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    return result.stdout


def test_top_level_import_needs_no_torch():
    out = _run("import sys, speechtrain, speechtrain.data; print('torch' in sys.modules, speechtrain.__version__)")
    assert out.split() == ["False", "0.1.0"]


def test_bridge_import_loads_neither_megatron_nor_transformer_engine():
    out = _run(
        "import sys, speechtrain.lightning, speechtrain.core.model, speechtrain.asr.conv_ctc;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformer_engine', 'hydra'}))"
    )
    assert out.strip() == "[]"


def test_public_names_of_the_bridge():
    out = _run("import speechtrain.lightning as L;print(all(hasattr(L, n) for n in L.__all__), sorted(L.__all__)[:3])")
    assert out.startswith("True")

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The folders are read when speechtrain.lightning is imported, so each case runs in a fresh interpreter. Importing
# Lightning takes seconds; two interpreters cover every variable both at its default and overridden.
_REPORT = """
import json, os
import speechtrain.lightning as st
from speechtrain.lightning import settings
assert st.SPEECHTRAIN_HOME == settings.SPEECHTRAIN_HOME
print(json.dumps({
    "home": str(settings.SPEECHTRAIN_HOME),
    "datasets": str(settings.SPEECHTRAIN_DATASETS_CACHE),
    "models": str(settings.SPEECHTRAIN_MODELS_CACHE),
    "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
}))
"""

_OWN_VARIABLES = (
    "SPEECHTRAIN_HOME",
    "SPEECHTRAIN_DATASETS_CACHE",
    "SPEECHTRAIN_MODELS_CACHE",
    "TOKENIZERS_PARALLELISM",
)


def _settings_in_fresh_process(home: Path, **variables: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _OWN_VARIABLES}
    env.update(HOME=str(home), **variables)
    result = subprocess.run([sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def home(tmp_path):
    folder = tmp_path / "user-home"
    folder.mkdir()
    return folder


def test_defaults_live_under_the_user_cache_and_tokenizers_parallelism_is_disabled(home):
    values = _settings_in_fresh_process(home, SPEECHTRAIN_MODELS_CACHE="~/weights")
    assert values == {
        "home": str(home / ".cache" / "speechtrain"),
        "datasets": str(home / ".cache" / "speechtrain" / "datasets"),
        "models": str(home / "weights"),
        "tokenizers_parallelism": "false",
    }


def test_home_override_moves_the_caches_not_set_and_a_set_tokenizers_flag_is_kept(home, tmp_path):
    root = tmp_path / "st-root"
    values = _settings_in_fresh_process(
        home, SPEECHTRAIN_HOME=str(root), SPEECHTRAIN_DATASETS_CACHE="~/corpora", TOKENIZERS_PARALLELISM="true"
    )
    assert values == {
        "home": str(root),
        "datasets": str(home / "corpora"),
        "models": str(root / "models"),
        "tokenizers_parallelism": "true",
    }

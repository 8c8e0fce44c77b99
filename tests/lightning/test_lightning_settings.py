import json
import os
import subprocess
import sys

import pytest

# The folders are read when speechtrain.lightning is imported, so each case runs in a fresh interpreter. The
# interpreters are started together (importing Lightning takes seconds) and each test reads its own.
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

_CASES = {
    "defaults": {},
    "home_only": {"SPEECHTRAIN_HOME": "{tmp}/st-root", "TOKENIZERS_PARALLELISM": "true"},
    "all_three": {
        "SPEECHTRAIN_HOME": "~/st",
        "SPEECHTRAIN_DATASETS_CACHE": "~/corpora",
        "SPEECHTRAIN_MODELS_CACHE": "{tmp}/weights",
        "TOKENIZERS_PARALLELISM": "false",
    },
}


@pytest.fixture(scope="module")
def fresh_processes(tmp_path_factory):
    """Per case: (user home, tmp folder, settings as seen by a fresh interpreter)."""
    tmp = tmp_path_factory.mktemp("settings")
    home = tmp / "user-home"
    home.mkdir()
    running = {}
    for name, variables in _CASES.items():
        env = {k: v for k, v in os.environ.items() if k not in _OWN_VARIABLES}
        env["HOME"] = str(home)
        env.update({k: v.format(tmp=tmp) for k, v in variables.items()})
        running[name] = subprocess.Popen(
            [sys.executable, "-c", _REPORT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        results[name] = json.loads(stdout.strip().splitlines()[-1])
    return home, tmp, results


def test_defaults_live_under_the_user_cache_and_tokenizers_parallelism_is_disabled(fresh_processes):
    home, _, results = fresh_processes
    assert results["defaults"] == {
        "home": str(home / ".cache" / "speechtrain"),
        "datasets": str(home / ".cache" / "speechtrain" / "datasets"),
        "models": str(home / ".cache" / "speechtrain" / "models"),
        "tokenizers_parallelism": "false",
    }


def test_home_override_moves_both_caches_and_a_set_tokenizers_flag_is_kept(fresh_processes):
    _, tmp, results = fresh_processes
    assert results["home_only"] == {
        "home": str(tmp / "st-root"),
        "datasets": str(tmp / "st-root" / "datasets"),
        "models": str(tmp / "st-root" / "models"),
        "tokenizers_parallelism": "true",
    }


def test_each_cache_is_overridable_and_user_folder_is_expanded(fresh_processes):
    home, tmp, results = fresh_processes
    assert results["all_three"] == {
        "home": str(home / "st"),
        "datasets": str(home / "corpora"),
        "models": str(tmp / "weights"),
        "tokenizers_parallelism": "false",
    }

"""Cache folders and process-wide environment defaults.

Each folder is read from its environment variable when this module is imported, so set the variables before
importing speechtrain (or pass explicit paths to the functions that take them).
"""

import os
from pathlib import Path

SPEECHTRAIN_HOME = Path(os.environ.get("SPEECHTRAIN_HOME", "~/.cache/speechtrain")).expanduser()
SPEECHTRAIN_DATASETS_CACHE = Path(
    os.environ.get("SPEECHTRAIN_DATASETS_CACHE", str(SPEECHTRAIN_HOME / "datasets"))
).expanduser()
SPEECHTRAIN_MODELS_CACHE = Path(
    os.environ.get("SPEECHTRAIN_MODELS_CACHE", str(SPEECHTRAIN_HOME / "models"))
).expanduser()

# Tokenizers that fork into dataloader workers warn (and may deadlock) unless this is decided up front.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

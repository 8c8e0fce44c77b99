"""Where the built-in corpora are kept."""

import os
from pathlib import Path


def default_datasets_cache() -> Path:
    """Folder for built-in datasets, read from the environment at call time.

    Returns:
        ``$SPEECHTRAIN_DATASETS_CACHE`` if set, else ``$SPEECHTRAIN_HOME/datasets``, else
        ``~/.cache/speechtrain/datasets``.
    """
    if os.environ.get("SPEECHTRAIN_DATASETS_CACHE"):
        return Path(os.environ["SPEECHTRAIN_DATASETS_CACHE"]).expanduser()
    if os.environ.get("SPEECHTRAIN_HOME"):
        return Path(os.environ["SPEECHTRAIN_HOME"]).expanduser() / "datasets"
    return Path.home() / ".cache" / "speechtrain" / "datasets"

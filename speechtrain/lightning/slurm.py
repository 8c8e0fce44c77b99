"""Lightning's SLURM detection, corrected for interactive allocations.

Lightning treats a job as an interactive session only when ``SLURM_JOB_NAME`` is exactly ``bash`` or
``interactive``. Clusters name interactive jobs ``<user>-bash``, ``.../interactive`` or leave the name empty;
Lightning then takes them for batch jobs and waits for ``srun``-launched ranks that never come. We count a job as
interactive when its name is empty or ends in ``bash`` or ``interactive``.
"""

import os

from lightning.fabric.plugins.environments import slurm as _lightning_slurm


def is_slurm_interactive_mode() -> bool:
    """Whether the current SLURM allocation is an interactive session (see module docstring)."""
    job_name = os.environ.get("SLURM_JOB_NAME") or ""
    return job_name == "" or job_name.endswith("bash") or job_name.endswith("interactive")


def patch_slurm_interactive_mode() -> None:
    """Make Lightning use :func:`is_slurm_interactive_mode`. Idempotent."""
    _lightning_slurm._is_slurm_interactive_mode = is_slurm_interactive_mode

"""Silence upstream messages our users cannot act on, so that the ones that matter stand out.

- Lightning's "Tip:" advertisements for its cloud services (logged on every trainer construction).
- Lightning 2.6's own use of a pytree API that torch 2.11 deprecated (``LeafSpec``): a warning about Lightning's
  code, printed during every ``fit``.
"""

import logging
import warnings


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip")


def silence_upstream_noise() -> None:
    """Install the filters (idempotent)."""
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _not_a_tip not in rank_zero_logger.filters:
        rank_zero_logger.addFilter(_not_a_tip)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

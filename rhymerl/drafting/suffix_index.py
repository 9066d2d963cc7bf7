"""The suffix index the history drafters query, and drafting from its matches: the compiled
core when it was built (``pip install`` builds it), else the Python reference, with a warning.

Both have one API (:mod:`rhymerl.drafting.suffix_reference` documents the algorithm):
``SuffixIndex`` (``add``, ``append``, ``match``), ``Matches`` (a row's occurrences; ``+``
pools two sources'), and the batch calls the controller makes once per decode step:
``longest_match_drafts`` (the controller's rule over occurrence sources, and the drafts),
and its parts ``match_batch``, ``draft_paths``, ``draft_trees``.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

try:
    from rhymerl.drafting._suffix_core import (Matches, SuffixIndex, draft_paths, draft_trees,
                                                longest_match_drafts, match_batch)
    COMPILED = True
except ImportError as e:  # a source checkout that was never installed: slower drafting, same drafts
    log.warning("the compiled suffix index is not built (%s); drafting uses the Python reference "
                "(reinstall with `pip install -e .` to build it)", e)
    from rhymerl.drafting.suffix_reference import (Matches, SuffixIndex, draft_paths, draft_trees,
                                                longest_match_drafts, match_batch)
    COMPILED = False

__all__ = ["COMPILED", "Matches", "SuffixIndex", "draft_paths", "draft_trees", "longest_match_drafts", "match_batch"]

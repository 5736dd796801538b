"""Old path of ``tracegym.rollout.branches``, kept for one release: branching and Monte Carlo continuation."""

import sys
import warnings

import tracegym.rollout.branches as _moved

warnings.warn("tracegym.rollout_branches moved to tracegym.rollout.branches", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

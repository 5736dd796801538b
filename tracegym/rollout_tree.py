"""Old path of ``tracegym.rollout.tree``, kept for one release: tree rollouts."""

import sys
import warnings

import tracegym.rollout.tree as _moved

warnings.warn("tracegym.rollout_tree moved to tracegym.rollout.tree", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

"""Old path of ``tracegym.rollout.team``, kept for one release: team rollouts."""

import sys
import warnings

import tracegym.rollout.team as _moved

warnings.warn("tracegym.rollout_team moved to tracegym.rollout.team", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

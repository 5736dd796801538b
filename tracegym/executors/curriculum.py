"""Old path of ``tracegym.rl.executors.curriculum``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.curriculum as _moved

warnings.warn("tracegym.executors.curriculum moved to tracegym.rl.executors.curriculum", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

"""Old path of ``tracegym.rl.executors.base``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.base as _moved

warnings.warn("tracegym.executors.base moved to tracegym.rl.executors.base", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

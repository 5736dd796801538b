"""Old path of ``tracegym.rl.executors.threads``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.threads as _moved

warnings.warn("tracegym.executors.threads moved to tracegym.rl.executors.threads", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

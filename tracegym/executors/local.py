"""Old path of ``tracegym.rl.executors.local``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.local as _moved

warnings.warn("tracegym.executors.local moved to tracegym.rl.executors.local", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

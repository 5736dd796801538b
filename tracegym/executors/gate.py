"""Old path of ``tracegym.rl.executors.gate``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.gate as _moved

warnings.warn("tracegym.executors.gate moved to tracegym.rl.executors.gate", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

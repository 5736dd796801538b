"""Old path of ``tracegym.rl.executors.ray_workers``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.ray_workers as _moved

warnings.warn("tracegym.executors.ray_workers moved to tracegym.rl.executors.ray_workers", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

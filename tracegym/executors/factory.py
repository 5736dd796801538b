"""Old path of ``tracegym.rl.executors.factory``, kept for one release."""

import sys
import warnings

import tracegym.rl.executors.factory as _moved

warnings.warn("tracegym.executors.factory moved to tracegym.rl.executors.factory", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved

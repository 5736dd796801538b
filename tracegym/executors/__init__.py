"""Old path of ``tracegym.rl.executors``, kept for one release."""

import warnings

from tracegym.rl.executors import *  # noqa: F401,F403
from tracegym.rl.executors import __all__  # noqa: F401

warnings.warn("tracegym.executors moved to tracegym.rl.executors", DeprecationWarning, stacklevel=2)

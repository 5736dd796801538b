"""Old home of teacher synthesis and its filters, kept for one release: the filters moved to
``tracegym.data.filters`` and the recipe to ``tracegym.recipes.synthesize``."""

import warnings

from tracegym.data.filters import *  # noqa: F401,F403
from tracegym.data.filters import __all__ as _filters_all
from tracegym.recipes.synthesize import *  # noqa: F401,F403
from tracegym.recipes.synthesize import __all__ as _recipe_all

warnings.warn("tracegym.synthesis moved: import filters from tracegym.data.filters and the recipe from "
              "tracegym.recipes.synthesize", DeprecationWarning, stacklevel=2)

__all__ = [*_filters_all, *_recipe_all]

"""Former home of the bit allocation, kept so ``memctl.controller.allocation`` still imports.

The allocation is its own package now: import from :mod:`memctl.allocation`.
"""

from memctl.allocation import *  # noqa: F403
from memctl.allocation import __all__ as __all__

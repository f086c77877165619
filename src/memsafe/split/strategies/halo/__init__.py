"""The halo strategy: windowed layers (convolutions, poolings) in a row run in one region on
extended chunks, each chunk computed with the halo its windows read.

- :mod:`.extended`: extended chunks, the region's span on them and the halos
  (:class:`~memsafe.split.strategies.halo.extended.Halo`), and the planner's entry
  (:data:`~memsafe.split.strategies.halo.extended.EXTENDED`, a ``memsafe.split.span.Spanning``);
- :mod:`.rules`: what the windowed primitives' split rules do on extended chunks (extensions of
  the rules in ``memsafe.split.prims``, registered when this package is imported).
"""

from memsafe.split.strategies.halo import rules
from memsafe.split.strategies.halo.extended import EXTENDED, Extended, Halo, Windowed

__all__ = ["EXTENDED", "Extended", "Halo", "Windowed", "rules"]

"""Match-and-replace rules: a pattern and its replacement, both plain JAX functions.

``Rule`` defines one, ``register_rule`` adds it to every ``memsafe.jit``;
``memsafe.rewrite.algebraic.rewritten(f)`` returns ``f`` with the rules (and reordering) applied.
"""

from memsafe.rules.pattern import Match, Rule
from memsafe.rules.registry import (
    active_rules,
    builtin_rules,
    register_rule,
    registered_rules,
    unregister_rule,
)

__all__ = [
    "Match",
    "Rule",
    "active_rules",
    "builtin_rules",
    "register_rule",
    "registered_rules",
    "unregister_rule",
]

"""Match-and-replace rules: a pattern and its replacement, both plain JAX functions.

``Rule`` defines one, ``register_rule`` adds it to every ``memsafe.jit``; ``rewrite(f)`` returns
``f`` with memsafe's rewriting passes (match-and-replace, then reordering) applied.
"""

from memsafe.rules.pattern import Match, Rule
from memsafe.rules.registry import (
    active_rules,
    builtin_rules,
    register_rule,
    registered_rules,
    unregister_rule,
)
from memsafe.rules.rewrite import rewrite

__all__ = [
    "Match",
    "Rule",
    "active_rules",
    "builtin_rules",
    "register_rule",
    "registered_rules",
    "rewrite",
    "unregister_rule",
]

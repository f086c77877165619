"""Which rules match-and-replace tries: memsafe's built-ins and the ones users register."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memsafe._jax import ClosedJaxpr
from memsafe.rules.pattern import Rule

_USER_RULES: list[Rule] = []


def builtin_rules() -> list[Rule]:
    """memsafe's own pattern rules (distances, products read in part)."""
    from memsafe.rules import distance, linalg

    return [*distance.DISTANCE_RULES, *linalg.LINALG_RULES]


def builtin_rewrites() -> list[Callable[[ClosedJaxpr], list[Any]]]:
    """memsafe's procedural rewrites (broadcasts and tiles feeding products, pads feeding
    poolings, products read in pieces): functions from a program to a list of
    :class:`memsafe.rules.tile.Rewrite`. (The sums of zero pads, :mod:`memsafe.rules.pads`,
    depend on the room: the ``inplace`` pass.)"""
    from memsafe.rules import pieces, tile, window

    return [*tile.REWRITES, *window.REWRITES, *pieces.REWRITES]


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to those every memsafe.jit tries (before the built-ins); returns it.

    A rule with the name of one already registered replaces it.
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"register_rule expects a memsafe.Rule, got {type(rule).__name__}")
    unregister_rule(rule.name)
    _USER_RULES.append(rule)
    return rule


def unregister_rule(name: str) -> bool:
    """Remove the user rule called ``name``; returns whether there was one."""
    before = len(_USER_RULES)
    _USER_RULES[:] = [r for r in _USER_RULES if r.name != name]
    return len(_USER_RULES) != before


def registered_rules() -> list[Rule]:
    """User rules, in registration order."""
    return list(_USER_RULES)


def active_rules() -> list[Rule]:
    """The rules match-and-replace tries: user rules first, then the built-ins."""
    return [*_USER_RULES, *builtin_rules()]

"""memsafe: run ordinary JAX programs under a memory limit, and see where their memory goes."""

from memsafe.batching import OuterJitWarning
from memsafe.errors import Blocker, ForwardModeError, MemoryLimitError
from memsafe.inspect import Report, inspect  # the function shadows the subpackage's name
from memsafe.jit import MemsafeFunction, jit
from memsafe.limits import format_bytes, parse_limit
from memsafe.log import set_verbosity
from memsafe.plan import Plan, RuleRecord, SplitRecord
from memsafe.plan_store import set_cache_dir
from memsafe.rules import Rule, register_rule
from memsafe.xla import Footprint

__version__ = "0.1.0"

__all__ = [
    "Blocker",
    "Footprint",
    "ForwardModeError",
    "MemoryLimitError",
    "MemsafeFunction",
    "OuterJitWarning",
    "Plan",
    "Report",
    "Rule",
    "RuleRecord",
    "SplitRecord",
    "format_bytes",
    "inspect",
    "jit",
    "parse_limit",
    "register_rule",
    "set_cache_dir",
    "set_verbosity",
]

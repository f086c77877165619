"""Errors memsafe raises, each naming what went wrong and where."""

from __future__ import annotations

from dataclasses import dataclass

from memsafe.limits import format_bytes


@dataclass(frozen=True)
class Blocker:
    """A value too large for the limit and the operation that stopped splitting it."""

    value: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    operation: str
    reason: str
    where: str = ""
    inherent: bool = False  # no chunked program gets past it (else: one may, without a rule)

    def describe(self) -> str:
        loc = f" at {self.where}" if self.where else ""
        return (
            f"  {self.value}: {self.dtype}{list(self.shape)} = {format_bytes(self.bytes)}; "
            f"{self.operation}{loc}: {self.reason}"
        )


class MemoryLimitError(MemoryError):
    """No rewrite could bring the program's footprint under the memory limit.

    ``limit``, ``footprint`` (best achieved, bytes or None), ``blockers`` (list of
    :class:`Blocker`) and ``minimum`` (smallest limit known to work, or None) are attributes.
    Values too small to close the gap between the best footprint and the limit are left out of
    ``blockers`` (``omitted``: how many, and the size each is under; ``memsafe.policy.REFUSAL``).
    ``missing_rules`` lists the operations that stopped a split for want of a rule: when it is
    empty no chunked program memsafe can build fits the limit (the limit is below what chunking
    reaches: arguments and outputs, the smallest chunks, sorts along the axis); when it is not,
    a chunked program may exist that memsafe has no rule for. The message says which.
    """

    def __init__(
        self,
        message: str,
        *,
        limit: int,
        footprint: int | None = None,
        blockers: list[Blocker] | None = None,
        minimum: int | None = None,
        omitted: tuple[int, int] = (0, 0),
    ) -> None:
        self.limit = limit
        self.footprint = footprint
        self.blockers = list(blockers or [])
        self.minimum = minimum
        lines = [message, f"  memory limit: {format_bytes(limit)} ({limit} bytes)"]
        if footprint is not None:
            lines.append(f"  best footprint reached: {format_bytes(footprint)} ({footprint} bytes)")
        if self.blockers:
            lines.append("  values that could not be split:")
            lines.extend(b.describe() for b in self.blockers)
        count, under = omitted
        if count:
            lines.append(
                f"  ({count} smaller values that could not be split are left out: each under "
                f"{format_bytes(under)}, too small to close the gap to the limit)"
            )
        lines.append(self._verdict())
        if minimum is not None:
            lines.append(
                f"  smallest limit known to work: {format_bytes(minimum)} ({minimum} bytes)"
            )
        super().__init__("\n".join(lines))

    @property
    def missing_rules(self) -> list[str]:
        """Operations that stopped a split for want of a rule (a chunked form may exist)."""
        return sorted({b.operation for b in self.blockers if not b.inherent})

    def _verdict(self) -> str:
        missing = self.missing_rules
        if missing:
            return (
                "  a chunked program may exist: memsafe has no rule to split through "
                f"{', '.join(missing)} here (docs: how-it-works, contributing)"
            )
        return "  no chunked program memsafe can build fits this limit"


class ForwardModeError(TypeError):
    """Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) was applied through a memsafe
    function, which is differentiated in reverse mode only; the message gives the workaround."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"memsafe: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) cannot go "
            f"through {name}: memsafe functions are differentiated in reverse mode, with a "
            "backward program verified under the memory limit.\n"
            "  Use reverse mode (jax.grad, jax.vjp, jax.jacrev), or apply memsafe.jit to the "
            "function that calls jax.jvp, so that the forward-mode computation is one program "
            "rewritten and verified under the limit:\n"
            "      memsafe.jit(lambda x, t: jax.jvp(f, (x,), (t,)), memory_limit=...)\n"
            "  where f is the plain function (not the memsafe one)."
        )

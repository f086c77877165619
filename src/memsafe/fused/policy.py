"""Where fused kernels are used: a frozen policy object, as every knob of memsafe."""

from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class FusedPolicy:
    """The knobs of :mod:`memsafe.fused`.

    Attributes:
        enabled: whether split regions are run as fused kernels where they can be. None: only
            where the default backend is ``gpu`` (on the CPU, XLA's chunk loops are as fast and
            the plans stay as they were).
        interpret: run the Pallas kernels in interpret mode (plain XLA operations; what the
            tests use on the CPU).
        rows: rows a kernel program holds along its largest row axis (other row axes: one).
        cols: positions of the split axis each step of the in-kernel loop streams.
        check_lowering: lower each kernel when planning (on a backend where it is compiled, a
            kernel Pallas cannot lower falls back to the chunk loops instead of failing).
    """

    enabled: bool | None = None
    interpret: bool = False
    rows: int = 64
    cols: int = 128
    check_lowering: bool = True

    def active(self) -> bool:
        """Whether fusion is on for this process's default backend."""
        if self.enabled is not None:
            return self.enabled
        return jax.default_backend() == "gpu"


#: The policy every split plan uses (tests replace it: ``interpret=True, enabled=True``).
FUSED = FusedPolicy()


def in_effect() -> FusedPolicy | None:
    """:data:`FUSED` where fusion is on (part of the keys plans are reused by, in this process
    and in the plan store: a plan made with other kernels is not reused), else None."""
    return FUSED if FUSED.active() else None

"""memsafe's tuning knobs, each defined once, in named frozen policy objects.

Every pass, planner and report reads its thresholds here at call time (``policy.SPLIT.share``),
so a test or an experiment changes one with ``dataclasses.replace`` on the module attribute::

    monkeypatch.setattr(policy, "SPLIT", dataclasses.replace(policy.SPLIT, floor_part=2**60))

The attempt search keeps its own :class:`memsafe.search.SearchPolicy` beside its driver, and
fused kernels theirs (:mod:`memsafe.fused.policy`); the speed model's measured machine
constants are in :mod:`memsafe.split.speed`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitPolicy:
    """How the split planner picks values, axes, chunks and strategies.

    Attributes:
        share: a value is split when it exceeds ``budget / share`` (and a loop whose body holds
            one is planned inside).
        many_share: where no value exceeds ``budget / share`` but the program is still
            estimated over the limit (many moderate values alive at once, as in a deep
            network's backward pass), values over ``budget / many_share`` are split.
        small: values up to ``budget / small`` may stay whole outside a region.
        similar_cost: axes whose loop counts are within this factor of the fewest count as
            equally cheap; among them a plain split beats an online-softmax one, then the
            thickest slab wins. A 67-row slab of a 10k x 1M kNN ran 1.7x slower than a
            6,850-column one with nearly the same loop count (150 vs 146): a thin side starves
            the GEMM and multiplies per-row calls.
        online_weight: weight of an online loop's iterations when choosing between axes: it
            rescales and rewrites its accumulators every chunk; on CPU it measured as fast as
            the split along the other axis, so a plain split wins unless the online one needs
            clearly fewer iterations.
        floor_part: a floored chunk (``memsafe.split.size.smallest_chunk``) may take this part
            of the budget by itself.
        gemm_side: free size on each side from which a dot_general counts as a matrix-matrix
            product (the speed model).
        max_left_out: most equations a region leaves out for reading a large value whole.
        max_stages: most loops a region may be staged into (each stage recomputes the region's
            shared prefix): a ResNet gradient with three batch-norms needs 13 (statistics, then
            what reads them, forward and backward).
        max_regions: most regions one run of the split pass emits.
        same_work_share: most work a loop's results that are the same on every chunk may add,
            as a share of the body's: each chunk computes them again (a counter costs nothing;
            a gradient summed over another axis would repeat the whole loop's work once per
            chunk).
        same_work_floor: work those results may always add (a loop whose body is its counter
            and a value passed through: a share of nothing is nothing).
        min_blocks_per_k: below this many blocks per wanted element, plain top_k is cheaper
            than block maxima.
        max_block: longest block of the block-maxima top_k: XLA's CPU backend reduces blocks of
            32 far faster than longer ones. top_k of 10 over rows of 100,000 (60 rows): blocks
            of 32 1.7 ms, 64 4.5 ms, 128 4.8 ms, lax.top_k 10.9 ms; over 10,000 rows of 10,083:
            65 ms, 235 ms, 258 ms and 213 ms; in the tiled selection's pass blocks of 32 reduce
            at 135-139 GFLOP/s, 64 at 82-88 and 16 at 115.
        row_batch: most rows whose candidates the tiled selection recomputes at once (64: 0.18
            s for 10,000 rows of 320 candidates of 64 floats, against 0.31 s at 256 and 0.37 s
            at 1,024).
        selection_share: the tiled selection's candidates, and the block maxima of one chunk
            of the loop, may use ``1 / selection_share`` of a chunk's operand bytes (what the
            plan budgets for).
    """

    share: int = 4
    many_share: int = 16
    small: int = 8
    similar_cost: float = 1.25
    online_weight: float = 1.25
    floor_part: int = 32
    gemm_side: int = 64
    max_left_out: int = 4
    max_stages: int = 16
    max_regions: int = 16
    same_work_share: float = 0.01
    same_work_floor: int = 4096
    min_blocks_per_k: int = 4
    max_block: int = 32
    row_batch: int = 64
    selection_share: int = 4


@dataclass(frozen=True)
class RewritePolicy:
    """Thresholds of the rewriting passes and the analyses they share.

    Attributes:
        share_of_budget: residuals are worth recomputing (the remat pass), and repeated blocks
            worth rolling into scans (the roll pass), when they take more than this share of
            the temporaries' budget.
        hoist_small: values up to this fraction of the temporary budget are left where they are
            (the hoist pass).
        constant_min_bytes: constants smaller than this are left as they are (not worth a fit).
        tie_min_bytes: values made from no data smaller than this are left where XLA makes
            them (the tie pass: a loop's or update's buffer made after its operands).
        invariant_min_bytes: loop constants smaller than this are left alone (holding them
            costs nothing worth a rewrite), unless they take at least ``invariant_room_share``
            of the room for temporaries (:meth:`invariant_floor`).
        invariant_room_share: see ``invariant_min_bytes``: a 16 KiB causal mask a transformer
            step's attention loops hold is a tenth of a 160 KiB room (fuzz seed 7560 fits with
            it recomputed, 402.1 KiB under 413.9 KiB; held, the best was 433.5 KiB).
        small_leaf_bytes: a generator may read values up to this size from outside (scalars,
            small vectors).
        max_cone: longest generator chain recomputed per iteration.
        min_peak_gain: a reordered chain is kept only where it lowers the estimated peak by this
            share of the written chain's peak plus its root's bytes: self-attention's ``(x @
            wq) @ (x @ wk).T`` reordered as ``x @ ((wq @ wk.T) @ x.T)`` saved 496 KiB beside
            its 16 MiB result at L=2048 and left the scores unsplittable inside the branch.
        max_match_rounds: rounds of matching (a rewrite can expose another: tile -> broadcast
            -> distance).
        heavy_reduction_bytes: reductions are heavy (materialize and break fusion) only above
            this many input bytes.
        period_min: repeated blocks shorter than this many equations are not looked for.
        min_gemm_depth: pairwise distances become a GEMM from this many features on. Measured
            on the CPU (kernel matvec, 20k x 20k, split under 64 MiB): d=3 GEMM 1.44 s vs fused
            0.67 s; d=8 GEMM 0.82 s vs fused 1.60 s; d=32 GEMM 1.14 s vs fused 4.51 s. Below
            it, the elementwise form is left to XLA's fusion (and to splitting, for memory).
        centre_sample: rows of each input a distance's centre is estimated from (an evenly
            strided sample).
        fold_bytes: values up to this size reduced from a larger value computed from no
            argument are evaluated while planning and put in the program as constants (the fold
            pass: XLA folds them in jax.jit's program, and a split loop would compute them at
            run time otherwise).
        fold_work_bytes: the largest value the fold pass evaluates to fold what is computed
            from it (a broadcast of ones summed).
    """

    share_of_budget: float = 0.5
    hoist_small: float = 1 / 8
    constant_min_bytes: int = 4096
    tie_min_bytes: int = 4096
    invariant_min_bytes: int = 64 * 1024
    invariant_room_share: int = 16
    small_leaf_bytes: int = 64 * 1024
    max_cone: int = 256
    min_peak_gain: float = 0.25
    max_match_rounds: int = 4
    heavy_reduction_bytes: int = 1 << 20
    period_min: int = 8
    min_gemm_depth: int = 6
    centre_sample: int = 64
    fold_bytes: int = 4096
    fold_work_bytes: int = 16 << 20

    def invariant_floor(self, room: int) -> int:
        """Bytes from which a loop constant is recomputed inside its loop, for ``room`` bytes of
        room for temporaries: ``invariant_min_bytes``, or a ``invariant_room_share``-th of the
        room where that is less (never under ``constant_min_bytes``), so that a program and its
        limit scaled down together move the same constants."""
        share = room // self.invariant_room_share
        return max(self.constant_min_bytes, min(self.invariant_min_bytes, share))


@dataclass(frozen=True)
class TuningPolicy:
    """When compile-option trials run (:mod:`memsafe.tuning`).

    Attributes:
        above_flops: programs with less floating-point work than this (about 10 ms on 2 cores)
            are not tuned: the second compile would cost more than the calls could gain.
        margin: the candidate replaces the verified executable only when its fastest timed call
            is this much faster than the verified executable's fastest.
    """

    above_flops: float = 2e9
    margin: float = 0.03


@dataclass(frozen=True)
class InspectPolicy:
    """What the inspector reports.

    Attributes:
        min_bytes: patterns costing fewer bytes than this are not reported.
        small_axis: a reduction over at most this many elements is short enough to write out
            explicitly.
        expansion: a kernel writing this many times more than it reads is materializing a
            broadcast.
        broadcast_min_bytes: materialized broadcasts smaller than this are not reported (RNG
            key tables and the like).
        min_branches: independent heavy branches live at once before the overlap is reported.
        split_min_bytes: temporaries smaller than this are not worth a split...
        split_min_fraction: ... nor those under this fraction of the footprint.
        constant_threshold: closed-over arrays at most this large are ignored (scalars and tiny
            tables).
    """

    min_bytes: int = 64 * 1024
    small_axis: int = 16
    expansion: int = 8
    broadcast_min_bytes: int = 1 << 20
    min_branches: int = 3
    split_min_bytes: int = 16 << 20
    split_min_fraction: float = 1 / 8
    constant_threshold: int = 64


@dataclass(frozen=True)
class RefusalPolicy:
    """What a refusal (``memsafe.MemoryLimitError``) reports.

    Attributes:
        gap_share: a value no rule could split is listed only when it is at least the gap
            between the best footprint reached and the limit over this share: splitting a
            smaller one could not close the gap (the last attempts shrink the budget until the
            planner tries values of a few bytes inside loop bodies). What is left out is
            counted, and no longer says that a rule is missing.
    """

    gap_share: int = 64


#: The split planner's knobs.
SPLIT = SplitPolicy()
#: The rewriting passes' knobs.
REWRITE = RewritePolicy()
#: The compile-option trials' knobs.
TUNING = TuningPolicy()
#: The inspector's knobs.
INSPECT = InspectPolicy()
#: What a refusal reports.
REFUSAL = RefusalPolicy()

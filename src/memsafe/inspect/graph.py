"""Kernels and the arrays between them, from a parsed HLO module.

Top-level instructions of the entry computation (and of while bodies, conditional branches and
called computations) are kernels, except views that own no buffer of their own (parameter,
tuple, get-tuple-element, bitcast, opt-barrier) which are resolved to the arrays they name. A
fusion's inside is not an array: it is what XLA keeps in registers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from memsafe.inspect.hlo import Computation, HloModule, Instruction, Shape, Source
from memsafe.inspect.model import Array, Kernel, Loop, LoopState

#: Instructions that produce no array worth drawing.
SILENT_OPS = frozenset({"after-all", "domain", "partition-id", "replica-id"})

Value = str | None | list["Value"]  # an array name, nothing, or a tuple of values


def flatten(value: Value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    out: list[str] = []
    for v in value:
        out.extend(flatten(v))
    return out


@dataclass
class ProgramGraph:
    """The kernel graph of one compiled program."""

    module: HloModule
    kernels: dict[str, Kernel] = field(default_factory=dict)
    arrays: dict[str, Array] = field(default_factory=dict)
    loops: dict[str, Loop] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    instructions: dict[str, Instruction] = field(default_factory=dict)

    def fused(self, kernel: str) -> list[Instruction]:
        """The instructions inside a fusion kernel (recursively), or the kernel's own."""
        inst = self.instructions[kernel]
        if inst.opcode != "fusion":
            return [inst]
        out: list[Instruction] = []
        stack = list(inst.called("calls"))
        while stack:
            comp = self.module.computations.get(stack.pop())
            if comp is None:
                continue
            for sub in comp.instructions:
                out.append(sub)
                if sub.opcode == "fusion":
                    stack.extend(sub.called("calls"))
        return out

    def top_level_in(self, kernel: str, computation: str) -> str:
        """The kernel of ``computation`` that holds ``kernel`` (itself if it is there)."""
        k = self.kernels[kernel]
        while k.computation != computation and k.parent is not None:
            k = self.kernels[k.parent]
        return k.name

    def ancestors(self, kernel: str) -> set[str]:
        """Kernels whose outputs ``kernel`` depends on, transitively (within the program)."""
        seen: set[str] = set()
        stack = [kernel]
        while stack:
            k = self.kernels[stack.pop()]
            for a in k.inputs:
                p = self.arrays[a].producer
                if p and p not in seen:
                    seen.add(p)
                    stack.append(p)
        return seen


def _fused_ops(module: HloModule, inst: Instruction) -> tuple[list[str], list[Source]]:
    """Opcodes and sources inside a fusion (recursively through nested fusions)."""
    ops: list[str] = []
    sources: list[Source] = []
    stack = list(inst.called("calls"))
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        for sub in module.computations[name].instructions:
            if sub.opcode == "parameter":
                continue
            ops.append(sub.opcode)
            if sub.source is not None:
                sources.append(sub.source)
            if sub.opcode == "fusion":
                stack.extend(sub.called("calls"))
    return ops, sources


def _trip_count(inst: Instruction) -> int | None:
    import re

    match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.backend_config)
    return int(match.group(1)) if match else None


class _Builder:
    def __init__(self, module: HloModule) -> None:
        self.module = module
        self.graph = ProgramGraph(module)

    def new_array(self, name: str, shape: Shape, role: str, producer: str | None, **kw) -> str:
        self.graph.arrays[name] = Array(
            name=name,
            shape=shape.dims,
            dtype=shape.dtype if not shape.is_tuple else "tuple",
            bytes=shape.bytes,
            producer=producer,
            role=role,
            **kw,
        )
        return name

    def arrays_for(self, name: str, shape: Shape, role: str, producer: str | None, **kw) -> Value:
        if shape.is_tuple:
            assert shape.elements is not None
            return [
                self.new_array(f"{name}[{i}]", e, role, producer, **kw)
                for i, e in enumerate(shape.elements)
            ]
        if shape.dtype == "token":
            return None
        return self.new_array(name, shape, role, producer, **kw)

    def run(self) -> ProgramGraph:
        for comp in self.module.computations.values():
            for inst in comp.instructions:
                self.graph.instructions[inst.name] = inst
        entry = self.module.entry_computation
        root = self.walk(entry, params=None, parent=None)
        outputs = flatten(root)
        for name in outputs:
            arr = self.graph.arrays[name]
            if arr.role in ("temporary", "loop state"):
                arr.role = "output"
        self.graph.outputs = outputs
        for kernel in self.graph.kernels.values():
            for a in kernel.inputs:
                consumers = self.graph.arrays[a].consumers
                if kernel.name not in consumers:
                    consumers.append(kernel.name)
        return self.graph

    def walk(self, comp: Computation, params: list[Value] | None, parent: str | None) -> Value:
        """Build kernels and arrays of ``comp``; ``params`` gives its parameters' values."""
        values: dict[str, Value] = {}
        for order, inst in enumerate(comp.instructions):
            values[inst.name] = self.visit(inst, order, values, params, parent)
        return values[comp.root.name]

    def visit(
        self,
        inst: Instruction,
        order: int,
        values: dict[str, Value],
        params: list[Value] | None,
        parent: str | None,
    ) -> Value:
        op = inst.opcode

        def arg(i: int) -> Value:
            return values.get(inst.operands[i]) if i < len(inst.operands) else None

        if op == "parameter":
            index = int(inst.literal) if inst.literal.strip().isdigit() else 0
            if params is not None:
                return params[index] if index < len(params) else None
            value = self.arrays_for(inst.name, inst.shape, "parameter", None, source=inst.source)
            self.graph.parameters.extend(flatten(value))
            return value
        if op == "get-tuple-element":
            tup = arg(0)
            index = int(inst.attr("index") or 0)
            if isinstance(tup, list) and index < len(tup):
                return tup[index]
            return tup
        if op == "tuple":
            return [values.get(o) for o in inst.operands]
        if op in ("bitcast", "opt-barrier", "add-dependency"):
            return arg(0)
        if op in SILENT_OPS:
            return None
        if op == "constant":
            if not inst.shape.dims:
                return None  # scalars are immediates inside kernels
            return self.arrays_for(
                inst.name,
                inst.shape,
                "constant",
                None,
                computation=inst.computation,
                parent=parent,
                source=inst.source,
            )
        if op == "call":
            callee = inst.called("to_apply")
            if callee and callee[0] in self.module.computations:
                args = [values.get(o) for o in inst.operands]
                return self.walk(self.module.computations[callee[0]], args, parent)
        return self.kernel(inst, order, values, parent)

    def kernel(
        self, inst: Instruction, order: int, values: dict[str, Value], parent: str | None
    ) -> Value:
        inputs: list[str] = []
        for o in inst.operands:
            for a in flatten(values.get(o)):
                if a not in inputs:
                    inputs.append(a)
        if inst.opcode == "fusion":
            ops, sources = _fused_ops(self.module, inst)
        else:
            ops, sources = [inst.opcode], []
        if inst.source is not None:
            sources.insert(0, inst.source)
        ranked = [s for s, _ in Counter(sources).most_common()]
        if inst.source is not None:  # the kernel's own line first, then the most frequent
            ranked.remove(inst.source)
            ranked.insert(0, inst.source)
        target = inst.attr("custom_call_target") or inst.attr("fft_type")
        kernel = Kernel(
            name=inst.name,
            opcode=inst.opcode,
            kind=inst.fusion_kind,
            shape=inst.shape,
            inputs=inputs,
            outputs=[],
            computation=inst.computation,
            order=order,
            ops=tuple(dict.fromkeys(ops)),
            sources=tuple(ranked),
            target=target,
            parent=parent,
        )
        self.graph.kernels[inst.name] = kernel
        kw = {"computation": inst.computation, "parent": parent, "source": inst.source}
        if inst.opcode == "while":
            value = self.loop(inst, values, parent, kw)
        elif inst.opcode == "conditional":
            value = self.arrays_for(inst.name, inst.shape, "temporary", inst.name, **kw)
            branches = inst.called("branch_computations") or (
                inst.called("true_computation") + inst.called("false_computation")
            )
            for k, branch in enumerate(branches):
                if branch in self.module.computations:
                    self.walk(
                        self.module.computations[branch],
                        [values.get(inst.operands[k + 1])] if k + 1 < len(inst.operands) else [],
                        inst.name,
                    )
        else:
            value = self.arrays_for(inst.name, inst.shape, "temporary", inst.name, **kw)
        kernel.outputs = flatten(value)
        return value

    def loop(self, inst: Instruction, values: dict[str, Value], parent: str | None, kw) -> Value:
        body = (inst.called("body") or [""])[0]
        cond = (inst.called("condition") or [""])[0]
        init = values.get(inst.operands[0]) if inst.operands else None
        init_elems = init if isinstance(init, list) else [init]
        shapes = inst.shape.elements if inst.shape.elements is not None else (inst.shape,)
        state: list[Value] = []
        for i, shape in enumerate(shapes):
            state.append(
                self.arrays_for(f"{inst.name}.state[{i}]", shape, "loop state", inst.name, **kw)
            )
        loop = Loop(inst.name, body, cond, _trip_count(inst), parent=parent)
        self.graph.loops[inst.name] = loop
        updates: Value = None
        if body in self.module.computations:
            updates = self.walk(self.module.computations[body], [state], inst.name)
        if cond in self.module.computations:
            self.walk(self.module.computations[cond], [state], inst.name)
        update_elems = updates if isinstance(updates, list) else [updates]
        for i, s in enumerate(state):
            arrays = flatten(s)
            update = flatten(update_elems[i]) if i < len(update_elems) else []
            loop.state.append(
                LoopState(
                    index=i,
                    array=arrays[0] if arrays else "",
                    init=flatten(init_elems[i]) if i < len(init_elems) else [],
                    update=update,
                    bytes=sum(self.graph.arrays[a].bytes for a in arrays),
                    invariant=bool(arrays) and update == arrays,
                )
            )
        return state if inst.shape.is_tuple else (state[0] if state else None)


def build_graph(module: HloModule) -> ProgramGraph:
    """The kernels, arrays and loops of a parsed HLO module."""
    return _Builder(module).run()

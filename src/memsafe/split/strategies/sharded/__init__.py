"""The sharded strategy: a split's axis sharded over the devices of a mesh (``jit(mesh=...)``).

- ``mesh``: the split wrapped to run inside ``jax.shard_map`` (``Sharding.shard``, the planner's
  ``mesh=``), its loops over each device's share, the sinks combined across devices.
- ``layout``: which mesh axes the loop runs over, and which split an input read whole.
- ``devices``: how a reducer's partials combine across devices (a collective, else gathered and
  folded in device order).

The core knows devices only through protocols: a split's ``devices`` and ``share``
(``memsafe.split.emit.Split``), the runner over devices (``memsafe.split.loop.DevicesRunner``)
and the opening chunk of a device (``memsafe.split.loop.Opening``).
"""

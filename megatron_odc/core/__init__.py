"""The ODC engine, without megatron: what one model's sharded parameters do over one DP group.

Modules, from the bottom up:

- ``layout``: parameters -> buckets -> each rank's shard ranges (pure arithmetic);
- ``groups``: the DP topology, shard groups x replica groups (hybrid sharding across hosts);
- ``agreement``: every DP rank built the same layout and holds the same weights (at construction);
- ``state``: the bucket states and the minibatch phase, each with its guarded transitions;
- ``storage``: the unsharded flat buffers every parameter is a view of; buffer names; owned runs;
- ``owned``: this rank's shards in transport memory and every write into them;
- ``p2p``: stateless fetch and push of storage groups over a transport;
- ``streams``: the overlap streams (fetch / compute / push) and their event ordering;
- ``telemetry``: per-minibatch time and bytes;
- ``engine``: ``ODCEngine``, the orchestration of all of the above;
- ``hooks``: ``ODCHooks``, the module and autograd hooks that drive the engine;
- ``fp8/``: FP8 parameters (maths, codec interface, emulated FP8 weights, recipe rules).

Imports only ``transport/`` from the package, and no megatron module.
"""

"""The engine: what one compiled round is made of.

Data as padded arrays (``data``), batches drawn inside the round
(``batching``), cohort sampling (``sampling``), the algorithm contract
(``algorithm``) and client work (``training``), executors (``executors``),
the round itself (``engine``), aggregation as tensor contractions
(``aggregation``), and the building blocks algorithms share: stacked
per-client state (``tree_util``, ``client_state``), in-round clustering
(``clustering``), parameter splits (``personalization``) and DP-SGD
accounting (``privacy``); evaluation (``evaluation``). Where the clients
live (the population store, the device or host layout, client rows in host
memory or files) is a room of its own, ``core.population``. Nothing here
reads flags.
"""

__all__ = []

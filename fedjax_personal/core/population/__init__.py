"""Where a federated population's clients live, beside the round's engine.

- ``clients``: the population store's clients on the host, by id
  (``PopulationStore``, ``Population``: unpadded examples, gathered by index).
- ``store``: how a population is stored (its files, the writer, the checks,
  opening a store).
- ``placement``: the device or the host layout, chosen by memory; the host
  layout's cohort feed and shape plan.
- ``rows_in_memory``: per-client state rows (personal models, control
  variates) kept in host memory and gathered per cohort.
- ``rows_in_files``: the same rows in files, each written when its client
  first trains.
"""

__all__ = []

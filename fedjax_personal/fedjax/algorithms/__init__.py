"""FedJAX's algorithms (``fedjax.algorithms``) as FedJAX builds them."""

from fedjax_personal.fedjax.algorithms import fed_avg

__all__ = ['fed_avg']


def __getattr__(name):
  # FedJAX's names not provided here, and misspelled ones: one line each
  from fedjax_personal.fedjax.missing import refuse  # noqa: PLC0415

  raise refuse('fedjax.algorithms', name)

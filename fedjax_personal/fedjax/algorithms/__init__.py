"""FedJAX's algorithms (``fedjax.algorithms``) as FedJAX builds them."""

from fedjax_personal.fedjax.algorithms import (
  agnostic_fed_avg,
  apfl,
  fed_avg,
  fed_prox,
  hyp_cluster,
  mime,
  mime_lite,
)
from fedjax_personal.fedjax.missing import refuse as _refuse

__all__ = [
  'agnostic_fed_avg',
  'apfl',
  'fed_avg',
  'fed_prox',
  'hyp_cluster',
  'mime',
  'mime_lite',
]


def __getattr__(name):
  # FedJAX's names not provided here, and misspelled ones: one line each
  raise _refuse('fedjax.algorithms', name)

"""FedJAX's ``fedjax.datasets.cifar100`` (0.0.17): Federated CIFAR-100 as the
project reads FedJAX's files (``fedjax_personal.datasets.cifar100``), ids looked
up as FedJAX looks them up (as the file stores them: bytes)."""

from fedjax_personal.datasets import cifar100 as _cifar100
from fedjax_personal.datasets.cifar100 import (  # noqa: F401  (FedJAX's names)
  CIFAR100_PIXELS_INVERSE_STDDEV,
  CIFAR100_PIXELS_MEAN,
  SPLITS,
  preprocess_batch,
  preprocess_batch_tff,
  preprocess_client,
  preprocess_image,
  preprocess_image_tff,
)
from fedjax_personal.fedjax.core.federated_data import with_exact_ids_of

__all__ = [
  'CIFAR100_PIXELS_INVERSE_STDDEV',
  'CIFAR100_PIXELS_MEAN',
  'cite',
  'load_data',
  'load_split',
  'preprocess_batch',
  'preprocess_batch_tff',
  'preprocess_client',
  'preprocess_image',
  'preprocess_image_tff',
  'SPLITS',
]

_CITATION = """@TECHREPORT{Krizhevsky09learningmultiple,
    author = {Alex Krizhevsky},
    title = {Learning multiple layers of features from tiny images},
    institution = {},
    year = {2009}
}"""


def cite() -> str:
  """The data set's BibTeX citation (FedJAX's ``cite``).

  Returns:
    The BibTeX entry.
  """
  return _CITATION


load_split = with_exact_ids_of(_cifar100.load_split)
load_data = with_exact_ids_of(_cifar100.load_data)

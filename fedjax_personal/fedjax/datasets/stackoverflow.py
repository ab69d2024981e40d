"""FedJAX's ``fedjax.datasets.stackoverflow`` (0.0.17): Federated Stack Overflow
as the project reads FedJAX's files
(``fedjax_personal.datasets.stackoverflow``), ids looked up as FedJAX looks them
up (as the file stores them: bytes)."""

from fedjax_personal.datasets import stackoverflow as _stackoverflow
from fedjax_personal.datasets.stackoverflow import (  # noqa: F401  (FedJAX's names)
  SPLITS,
  DefaultWordTokenizer,
  StackoverflowTokenizer,
  default_vocab,
  preprocess_client,
)
from fedjax_personal.fedjax.core.federated_data import with_exact_ids_of

__all__ = [
  'cite',
  'default_vocab',
  'DefaultWordTokenizer',
  'load_data',
  'load_split',
  'preprocess_client',
  'SPLITS',
  'StackoverflowTokenizer',
]

_CITATION = """@misc{stackoverflow2019,
 title={TensorFlow Federated Stack Overflow dataset},
  author={The TensorFlow Federated Authors.},
  year={2019},
}"""


def cite() -> str:
  """The data set's BibTeX citation (FedJAX's ``cite``).

  Returns:
    The BibTeX entry.
  """
  return _CITATION


load_split = with_exact_ids_of(_stackoverflow.load_split)
load_data = with_exact_ids_of(_stackoverflow.load_data)

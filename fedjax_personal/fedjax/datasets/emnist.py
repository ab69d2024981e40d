"""FedJAX's ``fedjax.datasets.emnist`` (0.0.17): Federated EMNIST as the project
reads FedJAX's files (``fedjax_personal.datasets.emnist``), ids looked up as
FedJAX looks them up (as the file stores them: bytes)."""

from fedjax_personal.datasets import emnist as _emnist
from fedjax_personal.datasets.emnist import (  # noqa: F401  (FedJAX's names)
  SPLITS,
  domain_id,
  preprocess_batch,
  preprocess_client,
  preprocess_split,
)
from fedjax_personal.fedjax.core.federated_data import with_exact_ids_of

__all__ = [
  'cite',
  'domain_id',
  'load_data',
  'load_split',
  'preprocess_batch',
  'preprocess_client',
  'preprocess_split',
  'SPLITS',
]

_CITATION = """@inproceedings{cohen2017emnist,
  title={EMNIST: Extending MNIST to handwritten letters},
  author={Cohen, Gregory and Afshar, Saeed and Tapson, Jonathan and
Van Schaik, Andre},
  booktitle={2017 International Joint Conference on Neural Networks (IJCNN)},
  pages={2921--2926},
  year={2017},
  organization={IEEE}
}"""


def cite() -> str:
  """The data set's BibTeX citation (FedJAX's ``cite``).

  Returns:
    The BibTeX entry.
  """
  return _CITATION


load_split = with_exact_ids_of(_emnist.load_split)
load_data = with_exact_ids_of(_emnist.load_data)

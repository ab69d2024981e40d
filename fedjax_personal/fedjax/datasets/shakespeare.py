"""FedJAX's ``fedjax.datasets.shakespeare`` (0.0.17): Federated Shakespeare as
the project reads FedJAX's files (``fedjax_personal.datasets.shakespeare``), ids
looked up as FedJAX looks them up (as the file stores them: bytes)."""

from fedjax_personal.datasets import shakespeare as _shakespeare
from fedjax_personal.datasets.natural_data import BOS, EOS, PAD  # noqa: F401
from fedjax_personal.datasets.shakespeare import OOV, SPLITS, TABLE, VOCAB_SIZE  # noqa: F401  (FedJAX's names)
from fedjax_personal.fedjax.core.federated_data import with_exact_ids_of

__all__ = [
  'BOS',
  'cite',
  'EOS',
  'load_data',
  'load_split',
  'OOV',
  'PAD',
  'preprocess_client',
  'SPLITS',
  'TABLE',
  'VOCAB_SIZE',
]

_CITATION = """@inproceedings{mcmahan2017communication,
  title={Communication-efficient learning of deep networks from
decentralized data},
  author={McMahan, Brendan and Moore, Eider and Ramage, Daniel and
Hampson, Seth and y Arcas, Blaise Aguera},
  booktitle={Artificial Intelligence and Statistics},
  pages={1273--1282},
  year={2017},
  organization={PMLR}
}"""


def cite() -> str:
  """The data set's BibTeX citation (FedJAX's ``cite``).

  Returns:
    The BibTeX entry.
  """
  return _CITATION


load_split = with_exact_ids_of(_shakespeare.load_split)
load_data = with_exact_ids_of(_shakespeare.load_data)


def preprocess_client(client_id, examples, sequence_length: int):
  """FedJAX's ``preprocess_client``: the project's (snippets joined with BOS /
  EOS, cut into x / y rows of ``sequence_length``), raising where FedJAX's
  raises: a client without snippets at ``sequence_length=1`` (its padded
  length is -1).

  Args:
    client_id: not used.
    examples: the client's raw ``snippets``.
    sequence_length: the rows' length.

  Returns:
    ``{'x', 'y'}`` int32 [rows, sequence_length].
  """
  if sequence_length == 1 and not len(examples['snippets']):
    # FedJAX's np.full([-1])
    raise ValueError('negative dimensions are not allowed')
  return _shakespeare.preprocess_client(client_id, examples, sequence_length)

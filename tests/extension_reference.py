"""docs/extension_reference.md, made from the docstrings of what an
extension (an algorithm, a data set or a model of one's own) sees: the test
``tests/test_docs.py`` fails when the page and the docstrings differ.

  python tests/extension_reference.py > docs/extension_reference.md
"""

import importlib
import inspect

#: (section, module, names), in the order a newcomer meets them.
SURFACE = [
  (
    'What a client sees',
    'fedjax_personal.core.training',
    ['ClientContext', 'Batch', 'LossStats'],
  ),
  (
    'What a client sees',
    'fedjax_personal.core.data',
    ['LocalData', 'ClientData'],
  ),
  (
    'Local training',
    'fedjax_personal.core.training',
    ['ClientWork', 'sgd_client_work', 'plain_objective', 'batch_loss'],
  ),
  (
    "FedAvg's parts",
    'fedjax_personal.algorithms.fedavg',
    [
      'variant',
      'ClientOutput',
      'ServerState',
      'make_client_work',
      'summed_upload',
      'server_step',
      'server_apply',
      'global_model_communication',
      'FEDAVG_SETTINGS',
    ],
  ),
  (
    'Uploads and aggregation',
    'fedjax_personal.core.aggregation',
    ['weighted_upload', 'upload_mean', 'weighted_mean', 'mix', 'group_means'],
  ),
  (
    'The algorithm and its round',
    'fedjax_personal.core.algorithm',
    [
      'FederatedAlgorithm',
      'ClientModels',
      'Communication',
      'RoundContext',
      'cohort_train_metrics',
    ],
  ),
  ('Settings', 'fedjax_personal.hparams', ['hparam']),
  ('Settings', 'fedjax_personal.config', ['AlgorithmSpec']),
  (
    'Data sets',
    'fedjax_personal.datasets.registry',
    [
      'register_arrays',
      'register',
      'ReadClients',
      'READER_ARGUMENTS',
      'register_pool',
      'Pool',
      'POOL_ARGUMENTS',
    ],
  ),
  (
    'Data sets',
    'fedjax_personal.datasets.natural_data',
    ['NaturalData', 'listed', 'take'],
  ),
  (
    'Data sets',
    'fedjax_personal.datasets.federated_data',
    ['InMemoryFederatedData'],
  ),
  (
    'Models',
    'fedjax_personal.models.registry',
    ['register', 'ModelBuilder', 'ModelOptions'],
  ),
  ('Models', 'fedjax_personal.models.model', ['Model', 'from_flax']),
  (
    'Models',
    'fedjax_personal.core.losses',
    ['StatsAndState', 'keep_model_state'],
  ),
]


def _signature(obj) -> str:
  """``(a, b, *, c)``: the parameters' names alone (annotations and
  defaults are in the docstring; their text differs between versions)."""
  if not (inspect.isclass(obj) or inspect.isfunction(obj)):
    return ''
  try:
    params = list(inspect.signature(obj).parameters.values())
  except (TypeError, ValueError):
    return ''
  names, star = [], False
  for p in params:
    if p.kind == p.KEYWORD_ONLY and not star:
      names.append('*')
      star = True
    names.append(
      {p.VAR_POSITIONAL: '*', p.VAR_KEYWORD: '**'}.get(p.kind, '') + p.name
    )
  return '(' + ', '.join(names) + ')'


def page() -> str:
  """The page's Markdown.

  Returns:
    The text.
  """
  out = [
    '# Extension reference',
    '',
    'What an algorithm, a data set or a model of your own sees, from the '
    'docstrings (made by',
    '`python tests/extension_reference.py > docs/extension_reference.md`; the '
    'suite checks',
    'it is current). How to use them: '
    '[add_an_algorithm.md](add_an_algorithm.md) and',
    'docs/add_a_data_set.md.',
    '',
  ]
  section = None
  for title, module_name, names in SURFACE:
    module = importlib.import_module(module_name)
    if title != section:
      out += [f'## {title}', '']
      section = title
    for name in names:
      obj = getattr(module, name)
      short = module_name.replace('fedjax_personal.', '')
      out.append(f'### `{short}.{name}{_signature(obj)}`')
      out.append('')
      doc = (
        inspect.getdoc(obj) if (inspect.isclass(obj) or callable(obj)) else None
      )
      if doc is None:
        doc = (
          f'`{obj!r}`'
          if not isinstance(obj, (set, frozenset))
          else ', '.join(f'`{v}`' for v in sorted(obj))
        )
      out += [doc, '']
  return '\n'.join(out).rstrip() + '\n'


if __name__ == '__main__':
  print(page(), end='')

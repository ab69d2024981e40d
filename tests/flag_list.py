"""Every script's flags as a list (name, type, default, choices), to compare
against the list written before the settings were last reorganised
(``tests/data/flag_list.json``; ``test_flag_list.py``).

  python tests/flag_list.py > tests/data/flag_list.json   # rewrite the list

Each script is loaded as a module (its ``__main__`` block does not run), in
one process, its flags read from absl's ``FLAGS`` and removed before the next.
"""

import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The scripts whose flags are listed, relative to the checkout.
SCRIPTS = (
  'scripts/run_experiment.py',
  'scripts/benchmark.py',
  'scripts/reproduce_debiasing.py',
  'scripts/reproduce_fedfomo.py',
  'scripts/reproduce_personalization.py',
  'scripts/reproduce_user_centric.py',
  'scripts/torch_reference.py',
  'benchmarks/populations.py',
  'benchmarks/probes/conv_in_a_loop.py',
)


def _flag(fl) -> dict:
  default = fl.default
  if isinstance(default, tuple):
    default = list(default)
  out = {'type': fl.flag_type(), 'default': default}
  choices = getattr(fl.parser, 'enum_values', None)
  if choices:
    out['choices'] = list(choices)
  return out


def flag_list(scripts=SCRIPTS) -> dict:
  """{script: {flag: {type, default[, choices]}}}, absl's own flags left out.

  Args:
    scripts: paths relative to the checkout.

  Returns:
    The list.
  """
  from absl import flags

  out = {}
  base = set(flags.FLAGS)
  for script in scripts:
    if script.endswith('run_experiment.py'):  # its flags are the entry's
      from fedjax_personal.run import experiment_entry  # noqa: F401
    runpy.run_path(os.path.join(ROOT, script), run_name='__flag_list__')
    names = sorted(set(flags.FLAGS) - base)
    out[script] = {n: _flag(flags.FLAGS[n]) for n in names}
    for n in names:
      delattr(flags.FLAGS, n)
  return out


if __name__ == '__main__':
  sys.path.insert(0, ROOT)
  json.dump(flag_list(), sys.stdout, indent=1, sort_keys=True, default=repr)
  print()

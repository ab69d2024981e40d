"""The package's two folders outside ``fedjax_personal/``, from this checkout.

``setup.cfg`` maps ``fedjax_personal.algorithms`` and
``fedjax_personal.datasets`` to the top-level folders ``algorithms/`` and
``datasets/``. An editable install records that mapping for the checkout it
was made from. Run from another checkout (its folder first on ``sys.path``),
``fedjax_personal`` comes from there while the two mapped subpackages would
still come from the installed checkout: two versions of the code, silently
mixed. When this ``fedjax_personal`` sits in a source checkout (a
``setup.cfg`` beside it mapping the folders) and the two folders would come
from elsewhere (or from nowhere: the checkout run without an install),
``use_this_checkout`` puts a finder first on ``sys.meta_path`` that takes
them from the same checkout, for these two names only. An installed package
(no ``setup.cfg`` beside it), and a checkout whose install already maps its
own folders, are left as they are: then importing the package adds no
import hook.
"""

import importlib.abc
import importlib.util
import os
import sys

__all__ = ['checkout_root', 'use_this_checkout']


MAPPED = ('algorithms', 'datasets')


class _CheckoutFinder(importlib.abc.MetaPathFinder):
  """Finds ``fedjax_personal.<folder>`` in one checkout's top-level folders."""

  def __init__(self, root: str):
    self.root = root

  def find_spec(self, name, path=None, target=None):
    package, _, sub = name.partition('.')
    if package != 'fedjax_personal' or sub not in MAPPED:
      return None
    folder = os.path.join(self.root, sub)
    return importlib.util.spec_from_file_location(
      name,
      os.path.join(folder, '__init__.py'),
      submodule_search_locations=[folder],
    )


def checkout_root(package_dir: str):
  """The checkout holding ``package_dir`` (``.../fedjax_personal``), or None
  when the package is installed rather than run from its sources.

  Args:
    package_dir: the ``fedjax_personal`` folder.

  Returns:
    The checkout's root, or None (an installed package).
  """
  root = os.path.dirname(os.path.abspath(package_dir))
  try:
    with open(os.path.join(root, 'setup.cfg'), encoding='utf-8') as f:
      cfg = f.read()
  except OSError:
    return None
  if not all(
    f'fedjax_personal.{m} = {m}' in cfg
    and os.path.isfile(os.path.join(root, m, '__init__.py'))
    for m in MAPPED
  ):
    return None
  return root


def use_this_checkout(package_dir: str) -> None:
  """Takes ``fedjax_personal.algorithms`` / ``.datasets`` from the checkout
  of ``package_dir``; refuses (ImportError, one line naming both folders)
  when one was already imported from another.

  Args:
    package_dir: the ``fedjax_personal`` folder.

  Returns:
    None.
  """
  root = checkout_root(package_dir)
  if root is None:
    return
  for m in MAPPED:
    loaded = sys.modules.get(f'fedjax_personal.{m}')
    where = os.path.dirname(
      os.path.abspath(getattr(loaded, '__file__', '') or '')
    )
    if loaded is not None and where != os.path.join(root, m):
      raise ImportError(
        f'fedjax_personal.{m} was imported from {where}, fedjax_personal from '
        f'{os.path.abspath(package_dir)}: two checkouts mixed; run from one '
        '(pip install -e . in the one you use)'
      )
  if all(
    _found_in(f'fedjax_personal.{m}', os.path.join(root, m)) for m in MAPPED
  ):
    return  # the install maps this checkout's folders already: no hook
  if not any(
    isinstance(f, _CheckoutFinder) and f.root == root for f in sys.meta_path
  ):
    sys.meta_path.insert(0, _CheckoutFinder(root))


def _found_in(name: str, folder: str) -> bool:
  """Whether Python's finders (without this module's) would import
  ``name`` from ``folder``."""
  try:
    spec = importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return False
  origin = getattr(spec, 'origin', None) or ''
  return os.path.dirname(os.path.abspath(origin)) == os.path.abspath(folder)

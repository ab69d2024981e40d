"""Haiku, FedJAX's model library, imported when a FedJAX model is built: an
optional dependency (``pip install 'fedjax_personal[fedjax]'``)."""

import importlib

__all__ = ['HaikuMissing', 'haiku']

EXTRA = "pip install 'fedjax_personal[fedjax]'"


class HaikuMissing(ImportError):
  """Haiku is not installed; the message names the extra that installs it."""


def haiku():
  """The ``haiku`` module, or ``HaikuMissing`` naming the extra.

  Returns:
    The module.
  """
  try:
    return importlib.import_module('haiku')
  except ImportError:
    raise HaikuMissing(
      f"FedJAX's models are Haiku modules and Haiku is not installed: {EXTRA}"
    ) from None

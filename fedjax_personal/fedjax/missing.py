"""FedJAX 0.0.17's public names this package does not provide yet: asked
for, each is refused in one line saying so and what to use instead."""

__all__ = ['refuse']

#: qualified FedJAX name -> what this project has instead (None: nothing yet).
NOT_PROVIDED: dict = {}


def refuse(package: str, name: str):
  """The one-line error for ``package.name`` (``package`` FedJAX's dotted
  name): AttributeError naming what is missing and what to use.

  Args:
    package: 'fedjax', 'fedjax.algorithms' or 'fedjax.models'.
    name: the attribute asked for.

  Returns:
    The AttributeError to raise.
  """
  qualified = f'{package}.{name}'
  if qualified in NOT_PROVIDED:
    instead = NOT_PROVIDED[qualified]
    return AttributeError(
      f'{qualified} (FedJAX 0.0.17) is not provided by fedjax_personal.fedjax'
      ' yet' + (f'; the project has {instead}' if instead else '')
    )
  return AttributeError(
    f'{qualified} is not a FedJAX 0.0.17 name (nor one of '
    'fedjax_personal.fedjax)'
  )

"""The error types of bad input, importable from anywhere in the package.

The scripts turn ``ConfigError`` (and only it) into a one-line message and
exit status 2; ``DataError`` is the data-file case of it.
"""


__all__ = ['ConfigError', 'DataError', 'HostLimitError']


class ConfigError(ValueError):
  """An invalid or inapplicable setting; ``name`` is the flag (or field) it
  concerns and the message starts with ``--name:``."""

  def __init__(self, name: str, message: str):
    self.name = name
    super().__init__(f'--{name}: {message}')


class DataError(ConfigError):
  """A data file that is missing, corrupted or not what it claims to be; the
  message starts with the file's path."""

  def __init__(self, message: str):
    ValueError.__init__(self, message)
    self.name = 'data_dir'


class HostLimitError(ConfigError):
  """A limit the host sets on the process (``ulimit -v``) below what a run
  needs; the message starts with the limit."""

  def __init__(self, limit: str, message: str):
    ValueError.__init__(self, f'{limit}: {message}')
    self.name = limit

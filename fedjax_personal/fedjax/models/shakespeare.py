"""FedJAX's Shakespeare model (``fedjax.models.shakespeare``): the
character-level LSTM of McMahan et al. ("Communication-Efficient Learning of
Deep Networks from Decentralized Data", arXiv:1602.05629) in Haiku, with
FedJAX's special tokens, loss (mean over the sequence, padding 0) and
metrics."""

import jax.numpy as jnp

from fedjax_personal.fedjax.core import models
from fedjax_personal.fedjax.models import _language
from fedjax_personal.fedjax.models._haiku import haiku

__all__ = ['create_lstm_model']


def create_lstm_model(
  vocab_size: int = 86,
  embed_size: int = 8,
  lstm_hidden_size: int = 256,
  lstm_num_layers: int = 2,
) -> models.Model:
  """FedJAX's character LSTM: embedding, ``lstm_num_layers`` LSTM + tanh
  layers, a dense layer to the full vocabulary.

  Args:
    vocab_size: characters, without PAD, BOS, EOS and OOV.
    embed_size: each character's embedding size.
    lstm_hidden_size: each LSTM's hidden size.
    lstm_num_layers: how many LSTM layers.

  Returns:
    The ``Model``.
  """
  hk = haiku()
  pad, bos, eos, oov = 0, vocab_size + 1, vocab_size + 2, vocab_size + 3
  full_vocab_size = vocab_size + 4
  mask = _language.logits_mask(full_vocab_size, (pad, bos, eos, oov))

  def forward_pass(batch):
    # [time, batch, embed]
    embeddings = hk.Embed(full_vocab_size, embed_size)(
      jnp.transpose(batch['x'])
    )
    layers = []
    for _ in range(lstm_num_layers):
      layers.extend([hk.LSTM(hidden_size=lstm_hidden_size), jnp.tanh])
    core = hk.DeepRNN(layers)
    output, _ = hk.static_unroll(
      core, embeddings, core.initial_state(batch_size=embeddings.shape[1])
    )
    output = hk.Linear(full_vocab_size)(output)
    return jnp.transpose(output, axes=(1, 0, 2))

  def train_loss(batch, preds):
    return jnp.mean(_language.per_token_loss(batch, preds, pad), axis=-1)

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch=_language.SAMPLE_BATCH,
    train_loss=train_loss,
    eval_metrics=_language.eval_metrics(pad, eos, oov, mask, truncation=False),
  )

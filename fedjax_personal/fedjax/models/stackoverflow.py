"""FedJAX's Stack Overflow model (``fedjax.models.stackoverflow``): the
word-level LSTM of Reddi et al. ("Adaptive Federated Optimization",
arXiv:2003.00295) in Haiku, with FedJAX's special tokens, loss (the
sentence's summed token loss, optionally over ``expected_length``) and
metrics."""

from typing import Optional

import jax.numpy as jnp

from fedjax_personal.fedjax.core import models
from fedjax_personal.fedjax.models import _language
from fedjax_personal.fedjax.models._haiku import haiku

__all__ = ['create_lstm_model']


def create_lstm_model(
  vocab_size: int = 10000,
  embed_size: int = 96,
  lstm_hidden_size: int = 670,
  lstm_num_layers: int = 1,
  share_input_output_embeddings: bool = False,
  expected_length: Optional[float] = None,
) -> models.Model:
  """FedJAX's word LSTM: embedding, ``lstm_num_layers`` (LSTM, tanh,
  projection to ``embed_size``), logits by a dense layer or the transposed
  input embedding plus a bias.

  Args:
    vocab_size: words, without PAD, BOS, EOS and OOV.
    embed_size: each word's embedding size.
    lstm_hidden_size: each LSTM's hidden size.
    lstm_num_layers: how many LSTM layers.
    share_input_output_embeddings: tie the output to the input embedding.
    expected_length: the training loss is the sentence's summed token loss
      over this constant (None: not scaled).

  Returns:
    The ``Model``.
  """
  hk = haiku()
  pad, bos, eos, oov = 0, 1, 2, vocab_size + 3
  full_vocab_size = vocab_size + 4
  mask = _language.logits_mask(full_vocab_size, (pad, bos, eos, oov))

  def forward_pass(batch):
    embedding_layer = hk.Embed(full_vocab_size, embed_size)
    # [time, batch, embed]
    embeddings = embedding_layer(jnp.transpose(batch['x']))
    layers = []
    for _ in range(lstm_num_layers):
      layers.extend(
        [
          hk.LSTM(hidden_size=lstm_hidden_size),
          jnp.tanh,
          hk.Linear(embed_size),
        ]
      )
    core = hk.DeepRNN(layers)
    output, _ = hk.static_unroll(
      core, embeddings, core.initial_state(batch_size=embeddings.shape[1])
    )
    if share_input_output_embeddings:
      output = jnp.dot(output, jnp.transpose(embedding_layer.embeddings))
      output = hk.Bias(bias_dims=[-1])(output)
    else:
      output = hk.Linear(full_vocab_size)(output)
    return jnp.transpose(output, axes=(1, 0, 2))

  def train_loss(batch, preds):
    sentence_loss = jnp.sum(
      _language.per_token_loss(batch, preds, pad), axis=-1
    )
    if expected_length is not None:
      return sentence_loss * (1.0 / expected_length)
    return sentence_loss

  return models.create_model_from_haiku(
    transformed_forward_pass=hk.transform(forward_pass),
    sample_batch=_language.SAMPLE_BATCH,
    train_loss=train_loss,
    eval_metrics=_language.eval_metrics(pad, eos, oov, mask, truncation=True),
  )

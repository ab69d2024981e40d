"""An LSTM over a whole sequence in few, large matmuls.

``lstm_sequence`` runs the parameters of an ``nn.OptimizedLSTMCell``
(``layers.LSTMCell``) over a sequence from zero state, with the input
projection before the time loop and the weight gradients after it;
``cell_kernels`` concatenates a cell's parameters for it.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_personal.models import initializers

__all__ = ['cell_kernels', 'lstm_sequence']


def _lstm_forward(x, w_in, w_rec, bias):
  """The LSTM over time with what the backward pass needs.

  ``x`` [B, T, D]; ``w_in`` [D, 4H], ``w_rec`` [H, 4H], ``bias`` [4H] in
  the gate order i, f, g, o. The input projection of every step is one
  matmul before the loop; each step adds ``h @ w_rec + bias`` to it in
  ``nn.OptimizedLSTMCell``'s order.

  Returns:
    (hs, cs, gates, tanh_cs): [T, B, H] states and cell states, [T, B, 4H]
    gate activations (sigmoid i, f, o; tanh g), [T, B, H] tanh(c).
  """
  zx = jnp.swapaxes(jnp.dot(x, w_in), 0, 1)
  batch, hidden = x.shape[0], w_rec.shape[0]

  def step(carry, z_in):
    c, h = carry
    zi, zf, zg, zo = jnp.split((jnp.dot(h, w_rec) + bias) + z_in, 4, axis=-1)
    i, f, g, o = nn.sigmoid(zi), nn.sigmoid(zf), jnp.tanh(zg), nn.sigmoid(zo)
    new_c = f * c + i * g
    tanh_c = jnp.tanh(new_c)
    new_h = o * tanh_c
    return (new_c, new_h), (
      new_h,
      new_c,
      jnp.concatenate([i, f, g, o], -1),
      tanh_c,
    )

  zero = jnp.zeros((batch, hidden), zx.dtype)
  return jax.lax.scan(step, (zero, zero), zx)[1]


@jax.custom_vjp
def lstm_sequence(x, w_in, w_rec, bias):
  """An LSTM over a whole sequence from zero state: ``nn.RNN`` of
  ``nn.OptimizedLSTMCell`` (``LSTMCell``) with its kernels concatenated by
  gate, computing the same numbers in fewer, larger matmuls.

  The forward pass projects every step's input in one matmul; the backward
  pass (the LSTM's equations, Hochreiter & Schmidhuber 1997, as cuDNN
  differentiates them) runs only the recurrent ``dz @ w_rec^T`` in its time
  loop and takes the weight gradients as one matmul each over all steps,
  where JAX's differentiation of the scan adds an [H, 4H] outer product into
  the recurrent kernel's gradient every step (one Stack Overflow step at
  batch 16 on one core: 149 ms to 114 ms; benchmarks/speed/README.md, "The
  language tasks and each row's bound"). Differentiable again in reverse and
  forward mode (Per-FedAvg's Hessian-vector products).

  Args:
    x: inputs [B, T, D].
    w_in: input kernels [D, 4H] (``ii, if, ig, io`` side by side).
    w_rec: recurrent kernels [H, 4H] (``hi, hf, hg, ho``).
    bias: recurrent biases [4H].

  Returns:
    The hidden states [B, T, H].
  """
  return jnp.swapaxes(_lstm_forward(x, w_in, w_rec, bias)[0], 0, 1)


def _lstm_sequence_fwd(x, w_in, w_rec, bias):
  hs, cs, gates, tanh_cs = _lstm_forward(x, w_in, w_rec, bias)
  return jnp.swapaxes(hs, 0, 1), (x, w_in, w_rec, hs, cs, gates, tanh_cs)


def _lstm_sequence_bwd(res, dh_out):
  x, w_in, w_rec, hs, cs, gates, tanh_cs = res
  steps, batch, hidden = hs.shape
  # state at t - 1
  before = lambda a: jnp.concatenate([jnp.zeros_like(a[:1]), a[:-1]], 0)

  def step(carry, inputs):
    dh_next, dc_next = carry
    dh_t, gate, tanh_c, c_prev = inputs
    i, f, g, o = jnp.split(gate, 4, axis=-1)
    dh = dh_t + dh_next
    dc = dc_next + dh * o * (1 - tanh_c * tanh_c)
    dz = jnp.concatenate(
      [
        dc * g * i * (1 - i),
        dc * c_prev * f * (1 - f),
        dc * i * (1 - g * g),
        dh * tanh_c * o * (1 - o),
      ],
      -1,
    )
    return (jnp.dot(dz, w_rec.T), dc * f), dz

  zero = jnp.zeros((batch, hidden), hs.dtype)
  _, dz = jax.lax.scan(
    step,
    (zero, zero),
    (jnp.swapaxes(dh_out, 0, 1), gates, tanh_cs, before(cs)),
    reverse=True,
  )
  flat = dz.reshape(steps * batch, -1)
  d_rec = jnp.dot(before(hs).reshape(steps * batch, hidden).T, flat)
  dz = jnp.swapaxes(dz, 0, 1)
  d_in = jnp.einsum('btd,btg->dg', x, dz)
  return jnp.dot(dz, w_in.T), d_in, d_rec, flat.sum(0)


lstm_sequence.defvjp(_lstm_sequence_fwd, _lstm_sequence_bwd)


def cell_kernels(cell_params) -> tuple:
  """(w_in, w_rec, bias) of an ``nn.OptimizedLSTMCell``'s (``LSTMCell``'s)
  parameters, concatenated in the gate order i, f, g, o (``lstm_sequence``).

  Args:
    cell_params: the cell's parameters (``ii``.. ``io``, ``hi``.. ``ho``).

  Returns:
    The three arrays.
  """
  cat = lambda kind, leaf: jnp.concatenate(
    [cell_params[f'{kind}{g}'][leaf] for g in initializers.GATES], -1
  )
  return cat('i', 'kernel'), cat('h', 'kernel'), cat('h', 'bias')

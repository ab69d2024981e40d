"""FedGC (Niu & Deng, "Federated Learning for Face Recognition with Gradient
Correction", AAAI 2022, arXiv 2112.07246) as PFLlib's ``clientgc.py`` /
``servergc.py`` run it: a shared body, and on each client a bias-free
classifier over the classes it has; the server averages the bodies and
corrects the classifiers with a regularizer that pushes every class's
embedding away from the other clients' class embeddings.

A round: each client trains its body (from the global one) and its own
classifier W_i on the cross-entropy over its own classes; the server
averages the bodies (examples-weighted) and keeps each W_i; then one SGD
step, at the client rate times lambda (PFLlib's ``-lam``), on every
client's classifier of

  Reg = sum_i sum_{c of i} -log( e^{E_c . E_c} / (e^{E_c . E_c}
        + sum_{j without c} sum_{c' of j} e^{W_j[c'] . E_c}) ),

E_c the mean over the clients that have c of their W[c] (held fixed), so
the gradient moves the classifiers of the clients without c (PFLlib's
``reg_train``; here in a stable log-sum-exp form, equal where PFLlib's
exponentials are finite).

Here a client's classifier is kept at the model's full class width, the
columns of the classes it lacks unused (its logits there are held at -1e9:
a softmax over its own classes, as PFLlib's narrower layer); which classes
a client has is counted once, in a pre-round phase. PFLlib's test maps a
test label the client never trained on to its first class
(``index_classes`` is 0 there), so such an example counts as correct when
the client predicts its first class: the default
(``--fedgc_absent_labels=first_class``); ``own`` scores every label as it
is. The classifiers are read across the population by the server each
round, so they are held on the device (not client rows).
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct
from optax import tree_utils as otu

from fedjax_personal.algorithms.fedavg import server_step, summed_upload
from fedjax_personal.config import (
  BATCHING,
  CLIENT_OPTIMIZER,
  SERVER_OPTIMIZER,
  WEIGHTING,
  AlgorithmSpec,
  BuildData,
  Declared,
  TrainingConfig,
  hparam,
)
from fedjax_personal.core.algorithm import (
  ClientModels,
  FederatedAlgorithm,
  PreRound,
  RoundContext,
  cohort_train_metrics,
)
from fedjax_personal.core.data import Array as HostOrDevice
from fedjax_personal.core.data import LocalData, label_counts
from fedjax_personal.core.losses import (
  Batch,
  LossStats,
  forward,
  logits_loss,
  per_example_stats,
)
from fedjax_personal.core.sampling import Cohort
from fedjax_personal.core.training import ClientContext, sgd_client_work
from fedjax_personal.core.tree_util import PyTree, tree_scatter
from fedjax_personal.models import HeadSplit, Model

__all__ = ['build', 'fedgc', 'FedGCConfig', 'gradient_correction', 'SPEC']

ABSENT_LABELS = ('first_class', 'own')
#: The logit of a class a client's classifier does not have.
ABSENT_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class FedGCConfig(Declared):
  """FedGC's own settings: the ``--fedgc_*`` flags (PFLlib's defaults)."""

  prefix: ClassVar[str] = 'fedgc'
  lamda: float = hparam(
    1.0,
    "The server step's rate as a multiple of the client rate (PFLlib -lam).",
    minimum=0,
    sweep=True,
  )
  absent_labels: str = hparam(
    'first_class',
    "How a client's test example of a class it never trained on is scored: "
    "'first_class' (PFLlib's: as its first class) or 'own' (as it is).",
    choices=ABSENT_LABELS,
  )


@struct.dataclass
class FedGCState:
  """FedGC's state: the global body, every client's classifier and classes.

  Attributes:
    params: the global body.
    opt_state: the server optimizer's state.
    heads: every client's classifier, [N, *features, C] (bias-free).
    present: bool [N, C], the classes each client has (the pre-round's).
  """

  params: PyTree
  opt_state: optax.OptState
  heads: jax.Array
  present: jax.Array


@struct.dataclass
class FedGCOutput:
  """What one FedGC client returns.

  Attributes:
    delta: the body's delta (its weighted share once summed).
    head: its classifier after training.
    num_examples: its training examples.
    stats: training statistics.
    num_steps: local steps taken.
  """

  delta: PyTree
  head: jax.Array
  num_examples: HostOrDevice
  stats: LossStats
  num_steps: Any = None


def restricted_logits(features, head, present):
  """z W over the classes the client has; ``ABSENT_LOGIT`` elsewhere."""
  logits = jnp.tensordot(features, head, axes=head.ndim - 1)
  return jnp.where(present, logits, ABSENT_LOGIT)


def gradient_correction(heads, present):
  """PFLlib's ``reg_train`` loss over every client's classifier.

  Args:
    heads: [N, D, C] the classifiers.
    present: bool [N, C].

  Returns:
    The scalar Reg (its gradient reaches the classifiers of the clients
    without each class; the class embeddings are held fixed).
  """
  w = present.astype(heads.dtype)
  n_c = jnp.sum(w, axis=0)
  # E_c
  emb = jax.lax.stop_gradient(
    jnp.einsum('ndc,nc->cd', heads, w) / jnp.maximum(n_c, 1.0)[:, None]
  )
  own = jnp.sum(emb * emb, axis=1)  # E_c . E_c
  # s[c, j, c'] = W_j[c'] . E_c, counted where j lacks c and has c'
  s = jnp.einsum('cd,jdk->cjk', emb, heads)
  counted = (1.0 - w).T[:, :, None] * w[None, :, :] > 0
  # log sum_{j without c} sum_{c' of j} e^{...}
  others = jax.nn.logsumexp(jnp.where(counted, s, -jnp.inf), axis=(1, 2))
  term = jax.nn.softplus(others - own)  # -log(a / (a + b))
  term = jnp.where(jnp.any(counted, axis=(1, 2)), term, 0.0)
  return jnp.sum(n_c * term)


def fedgc(
  model: Model,
  num_clients: int,
  num_classes: int,
  client_optimizer: optax.GradientTransformation,
  batching,
  server_lr: float,
  absent_labels: str = 'first_class',
  server_optimizer=None,
  weighting: str = 'num_examples',
) -> FederatedAlgorithm:
  """Builds FedGC.

  Args:
    model: the model (with a head; its body is shared).
    num_clients: N.
    num_classes: C.
    client_optimizer: the client optimizer (body and classifier).
    batching: local batching.
    server_lr: the classifiers' correction step (client rate x lambda).
    absent_labels: 'first_class' (PFLlib's scoring) or 'own'.
    server_optimizer: on the bodies' mean delta (default ``optax.sgd(1)``).
    weighting: the mean's weighting (``fedavg.WEIGHTINGS``).

  Returns:
    The ``FederatedAlgorithm``.
  """
  if absent_labels not in ABSENT_LABELS:
    raise ValueError(f'absent_labels must be one of {ABSENT_LABELS}')
  head: HeadSplit = model.require_head('--algorithm=fedgc')
  server_optimizer = server_optimizer or optax.sgd(1.0)
  dims = head.feature_shape
  fan_in = 1
  for d in dims:
    fan_in *= d

  def init(key: jax.Array) -> FedGCState:
    k_model, k_heads = jax.random.split(key)
    body = head.split(model.init(k_model)).body
    bound = 1.0 / jnp.sqrt(fan_in)  # PyTorch's Linear
    heads = jax.random.uniform(
      k_heads, (num_clients, *dims, num_classes), jnp.float32, -bound, bound
    )
    return FedGCState(
      body,
      server_optimizer.init(body),
      heads,
      jnp.ones((num_clients, num_classes), bool),
    )

  # a head of the model's own shape, for its forward pass (its output unused)
  _, model_head = head.split(jax.eval_shape(model.init, jax.random.key(0)))
  blank_head = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), model_head)

  def server_broadcast(state: FedGCState, cohort: Cohort, rc: RoundContext):
    i = cohort.idx
    return state.params, (
      state.heads.at[i].get(mode='clip'),
      state.present.at[i].get(mode='clip'),
    )

  def objective_fn(ctx: ClientContext):
    present = ctx.state[1]

    def objective(parts, batch: Batch):
      out = forward(
        model, head.merge(parts['body'], blank_head), batch, features=True
      )
      logits = restricted_logits(out.features, parts['head'], present)
      return logits_loss(model, logits, batch)

    return objective

  def final(ctx: ClientContext, carry):
    return FedGCOutput(
      delta=otu.tree_sub(ctx.shared, carry.params['body']),
      head=carry.params['head'],
      num_examples=ctx.data.train.num_examples,
      stats=carry.stats,
      num_steps=carry.num_steps,
    )

  work = sgd_client_work(
    objective_fn,
    client_optimizer,
    batching,
    final,
    start_fn=lambda ctx: {'body': ctx.shared, 'head': ctx.state[0]},
    trained_like=lambda p: {
      'body': head.split(p).body,
      'head': jnp.zeros((*dims, num_classes), jnp.float32),
    },
  )

  def server_update(
    state: FedGCState, cohort: Cohort, out: FedGCOutput, rc: RoundContext
  ):
    params, opt_state = server_step(
      state.params, state.opt_state, out.delta, server_optimizer
    )
    # the cohort's classifiers (a padded slot's index is N: dropped)
    heads = tree_scatter(state.heads, cohort.idx, out.head)
    grad = jax.grad(gradient_correction)(heads, state.present)
    return (
      dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        heads=heads - server_lr * grad,
      ),
      cohort_train_metrics(out.stats, cohort.mask),
    )

  def classes(shared, data: LocalData, key):
    del shared, key
    return label_counts(data.train, num_classes) > 0

  def classes_update(state: FedGCState, present, rc: RoundContext):
    del rc
    return dataclasses.replace(state, present=present), {}

  def client_models(state: FedGCState) -> ClientModels:
    def one(w, present):
      top = {
        'kernel': w,
        'bias': jnp.where(present, 0.0, ABSENT_LOGIT).astype(w.dtype),
      }
      return head.merge(state.params, top)

    return ClientModels.personal(
      jax.vmap(one)(state.heads, state.present), num_clients
    )

  def evaluate_client(params, local: LocalData, test, key) -> LossStats:
    del key
    logits = model.apply(params, test.x)
    y = test.y
    if absent_labels == 'first_class':
      present = label_counts(local.train, num_classes) > 0
      first = jnp.argmax(present)
      y = jnp.where(present[jnp.clip(y, 0, num_classes - 1)], y, first)
    mask = jnp.arange(test.x.shape[0]) < test.num_examples
    return per_example_stats(logits, y, mask)

  return FederatedAlgorithm(
    name='fedgc',
    model=model,
    init=init,
    server_broadcast=server_broadcast,
    client_work=summed_upload(work, weighting),
    server_update=server_update,
    client_models=client_models,
    evaluate_client=evaluate_client,
    pre_round=PreRound(
      due=lambda t: t == 0, update=classes_update, client=classes
    ),
  )


def build(
  training: TrainingConfig,
  config: FedGCConfig,
  model: Model,
  data: BuildData,
) -> FederatedAlgorithm:
  """FedGC, built as ``AlgorithmSpec.build`` says; its settings
  ``FedGCConfig``."""
  return fedgc(
    model,
    data.num_clients,
    data.num_classes,
    training.make_client_optimizer(),
    training.batching(),
    training.client_lr * config.lamda,
    config.absent_labels,
    training.make_server_optimizer(),
    training.filled_weighting(),
  )


SPEC = AlgorithmSpec(
  'fedgc',
  FedGCConfig,
  build,
  CLIENT_OPTIMIZER | BATCHING | WEIGHTING | SERVER_OPTIMIZER,
  summary='FedGC (Niu & Deng 2022, as PFLlib runs it): shared body, '
  'per-client classifiers corrected on the server',
)

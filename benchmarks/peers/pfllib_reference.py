"""What PFLlib's own code computes for the algorithms it shares with this
project, recorded on a tiny made federation: the reference
``tests/test_pfllib_reference.py`` compares each algorithm here with.

Runs where PyTorch installs (the bench extra: ``pip install -e '.[bench]'``)
on PFLlib's ``system/`` folder at the commit below, nothing of it committed
here::

  git -C PFLlib archive d832e76f6a23b833038949ec1e4fdefe63a4d350 system \\
      | tar -x -C /tmp/pfllib
  python benchmarks/peers/pfllib_reference.py --pfllib=/tmp/pfllib/system \\
      --out=tests/data/pfllib_reference.npz

PFLlib's server and client classes run as its ``main.py`` builds them
(``BaseHeadSplit`` where its ``main.py`` splits the model), with its
``FedAvgCNN`` (conv 32, 64 @5x5, dense 512, ``fc`` 10; its ``dim`` set for 16x16
inputs) from
``torch.manual_seed(0)``, on 4 clients of 16 made 16x16 images each. What
is fed, not drawn: every client trains on batches of its 16 examples (one
batch per epoch, so PyTorch's shuffle changes only the order of a sum), all
clients join every round, and the rounds are the server's own ``train``
loop (its ``global_rounds`` + 1 = ``ROUNDS`` passes), its files not
written; FedBABU's loop is spelled out, to record its global model before
its last pass. Its data reader is replaced by the made arrays;
``h5py`` and ``matplotlib``, which only its result files and its DLG
attack use, by stand-ins where they are not installed.

FedGen's random draws (its labels by ``np.random.choice`` and its noise by
``torch.rand``) are replaced by fixed ones, ``fedgen_labels`` and
``fedgen_noise``, which the test feeds this project's FedGen too; its
generator's initial and final weights are recorded.

Recorded per algorithm (keys ``<algorithm>/...``): the global model after
``ROUNDS`` rounds (each leaf projected on fixed random directions,
``project``) and the personal part a client keeps (in this project's
layout: Flax names, HWIO kernels), and each client's correct test
predictions as PFLlib's ``test_metrics`` counts them, after its own last
step (FedBABU: one more round of local training and ``fine_tune``, as its
``train`` ends); also the made data and the initial weights.
"""

import argparse
import copy
import os
import sys
import tempfile
import types

import numpy as np

PFLLIB_COMMIT = 'd832e76f6a23b833038949ec1e4fdefe63a4d350'
NUM_CLIENTS, TRAIN, TEST, NUM_CLASSES = 4, 16, 8, 10
#: Made images of 16x16 (FedAvgCNN's ``dim``: 64 features after its
#: convolutions, 90K parameters, not MNIST's 1,024 and 582K).
SIDE, DIM = 16, 64
#: Parameters are recorded as projections on PROJECTIONS fixed random unit
#: directions per leaf (``project``), not whole.
PROJECTIONS = 16
ROUNDS, LOCAL_EPOCHS, LR = 2, 2, 0.05
#: This project's name -> PFLlib's: its ``-algo``, server module and class.
PFLLIB = {
  'fedavg': ('FedAvg', 'serveravg', 'FedAvg'),
  'fedlc': ('FedLC', 'serverlc', 'FedLC'),
  'fedntd': ('FedNTD', 'serverntd', 'FedNTD'),
  'fedbabu': ('FedBABU', 'serverbabu', 'FedBABU'),
  'fedrod': ('FedROD', 'serverrod', 'FedROD'),
  'feddbe': ('FedDBE', 'serverdbe', 'FedDBE'),
  'fedgh': ('FedGH', 'servergh', 'FedGH'),
  'pflda': ('PFL-DA', 'serverda', 'PFL_DA'),
  'fedgc': ('FedGC', 'servergc', 'FedGC'),
  'fedcac': ('FedCAC', 'servercac', 'FedCAC'),
  'fedas': ('FedAS', 'serveras', 'FedAS'),
  'fedpac': ('FedPAC', 'serverpac', 'FedPAC'),
  'fedcp': ('FedCP', 'servercp', 'FedCP'),
  'gpfl': ('GPFL', 'servergpfl', 'GPFL'),
  'moon': ('MOON', 'servermoon', 'MOON'),
  'fedproto': ('FedProto', 'serverproto', 'FedProto'),
  'fd': ('FD', 'serverfd', 'FD'),
  'fml': ('FML', 'serverfml', 'FML'),
  'fedala': ('FedALA', 'serverala', 'FedALA'),
  'fedamp': ('FedAMP', 'serveramp', 'FedAMP'),
  'fedamp_pfllib': ('FedAMP', 'serveramp', 'FedAMP'),
  'fedmtl': ('FedMTL', 'servermtl', 'FedMTL'),
  'fedphp': ('FedPHP', 'serverphp', 'FedPHP'),
  'fedcross': ('FedCross', 'servercross', 'FedCross'),
  'fedcross_most_similar': ('FedCross', 'servercross', 'FedCross'),
  'fedkd': ('FedKD', 'serverkd', 'FedKD'),
  'fedgen': ('FedGen', 'servergen', 'FedGen'),
  'fedpcl': ('FedPCL', 'serverpcl', 'FedPCL'),
  'apple': ('APPLE', 'serverapple', 'APPLE'),
  'local': ('Local', 'serverlocal', 'Local'),
  'fedprox': ('FedProx', 'serverprox', 'FedProx'),
  'fedper': ('FedPer', 'serverper', 'FedPer'),
  'fedrep': ('FedRep', 'serverrep', 'FedRep'),
  'lg_fedavg': ('LG-FedAvg', 'serverlg', 'LG_FedAvg'),
  'ditto': ('Ditto', 'serverditto', 'Ditto'),
  'scaffold': ('SCAFFOLD', 'serverscaffold', 'SCAFFOLD'),
  'pfedme': ('pFedMe', 'serverpFedMe', 'pFedMe'),
}
#: Those PFLlib's main.py gives its model with ``fc`` the identity (the
#: features are its output).
IDENTITY_HEAD = ('fedpcl',)
#: Those PFLlib's main.py gives a BaseHeadSplit model.
SPLIT = (
  'fedper',
  'fedrep',
  'lg_fedavg',
  'fedas',
  'fedgen',
  'fedbabu',
  'fedcp',
  'feddbe',
  'fedphp',
  'fedgc',
  'fedgh',
  'fedkd',
  'fedlc',
  'fedpac',
  'fedproto',
  'fedrod',
  'gpfl',
  'moon',
  'pflda',
)
#: The algorithms recorded, with their own settings in the record (PFLlib's
#: argument names; this project's flags are ``--<name>_<argument>``).
ALGORITHMS = {
  'fedlc': dict(tau=1.0),
  'fedntd': dict(beta=1.0, tau=2.0),
  'fedbabu': dict(fine_tuning_epochs=2),
  'fedrod': {},
  'feddbe': dict(kl_weight=1.0, momentum=0.1),
  'fedgh': dict(server_learning_rate=0.5),
  'pflda': dict(lamda=1.0),
  'fedgc': dict(lamda=2.0),
  'fedcac': dict(tau=0.5, beta=2),
  'fedas': {},
  'fedpac': dict(lamda=1.0),
  'fedcp': dict(lamda=1.0),
  'gpfl': dict(lamda=0.5, mu=0.1),
  'moon': dict(mu=1.0, tau=0.5),
  'fedproto': dict(lamda=1.0),
  'fd': dict(lamda=0.5),
  'fml': dict(alpha=0.5, beta=0.5),
  # the whole share (its start drawn by Python's random: none to draw)
  'fedala': dict(eta=1.0, rand_percent=100),
  # with the proximal term live (``fedamp_live``), and as PFLlib runs it
  'fedamp': dict(alphaK=0.2, sigma=0.5, lamda=1.0),
  'fedamp_pfllib': dict(alphaK=0.2, sigma=0.5, lamda=1.0),
  'fedmtl': {},
  'fedphp': dict(lamda=0.3, mu=0.6),
  'fedcross': dict(fedcross_alpha=0.7, collaberative_model_select_strategy=1),
  'fedcross_most_similar': dict(
    fedcross_alpha=0.7, collaberative_model_select_strategy=2
  ),
  'fedkd': dict(mentee_learning_rate=0.03, T_start=0.9, T_end=0.95),
  'fedgen': dict(
    noise_dim=8,
    hidden_dim=16,
    generator_learning_rate=0.01,
    server_epochs=5,
    localize_feature_extractor=False,
  ),
  'fedpcl': dict(tau=0.5),
  # the relationship vectors learned (PFLlib's -dlr 0 keeps them uniform)
  'apple': dict(dr_learning_rate=1.0, mu=0.5, L=1.0),
  # the seeds' baselines PFLlib also has (its versions, where they differ, in
  # OURS and the docs)
  'local': {},
  # mu large enough that its pull shows in two steps of lr 0.05
  'fedprox': dict(mu=5.0),
  'fedper': {},
  # its head epochs as this project's FedRep preset's (5 x the shared
  # phase's; PFLlib's -pls is 1, this project's --partial_personal_epochs)
  'fedrep': dict(plocal_epochs=5 * LOCAL_EPOCHS),
  'lg_fedavg': {},
  # its personal epochs as this project's (the same batches: the local
  # epochs); -mu is this project's --ditto_lam
  'ditto': dict(mu=1.0, plocal_epochs=LOCAL_EPOCHS),
  'scaffold': {},
  # this project's lambda; beta 1: the server's mean (PFLlib's -bt 0 keeps
  # the global model at its initialization)
  'pfedme': dict(lamda=15.0, beta=1.0),
}
#: Records of an algorithm under another setting: record -> algorithm.
RECORDED_AS = {
  'fedamp_pfllib': 'fedamp',
  'fedcross_most_similar': 'fedcross',
}
#: PFLlib's argument names that this project's flags spell otherwise (None:
#: a number this project spells as a word, given in ``OURS``).
FLAG_NAMES = {
  'alphaK': 'alpha_k',
  'fedcross_alpha': 'alpha',
  'collaberative_model_select_strategy': None,
  'T_start': 't_start',
  'T_end': 't_end',
  'generator_learning_rate': 'generator_lr',
  'localize_feature_extractor': None,
  'dr_learning_rate': 'dr_lr',
  'L': 'decay_share',
  'plocal_epochs': None,
}
#: ``FLAG_NAMES`` of one algorithm, where it spells an argument otherwise.
ALGORITHM_FLAG_NAMES = {
  'ditto': {'mu': 'lam'},
  'pfedme': {
    'lamda': 'lam',
    'p_learning_rate': 'personal_lr',
    'K': 'inner_steps',
    'beta': None,  # this project's server takes the mean (beta 1)
  },
}


def flag_name(algorithm, argument):
  """This project's setting (under the algorithm's prefix) for PFLlib's
  ``argument`` of ``algorithm``, or None (given otherwise)."""
  names = {**FLAG_NAMES, **ALGORITHM_FLAG_NAMES.get(algorithm, {})}
  return names.get(argument, argument)


def our_flags(algorithm, arguments):
  """This project's flags (``--<algorithm>_<setting>``) for PFLlib's
  ``arguments`` of ``algorithm`` (``flag_name``'s; those it names None
  left out)."""
  flags = {}
  for argument, value in arguments.items():
    name = flag_name(algorithm, argument)
    if name is not None:
      flags[f'{algorithm}_{name}'] = value
  return flags


#: Those whose clients keep their own models, recorded client by client.
OWN_MODELS = (
  'local',
  'ditto',
  'fedper',
  'fedrep',
  'lg_fedavg',
  'fedgh',
  'pflda',
  'fedcac',
  'fedas',
  'fedpac',
  'fedproto',
  'fd',
  'fml',
  'fedala',
  'fedamp',
  'fedamp_pfllib',
  'fedmtl',
  'fedphp',
  'fedcross',
  'fedcross_most_similar',
  'fedkd',
  'fedpcl',
  'apple',
)
#: Those compared by their global model alone: pFedMe's clients'
#: ``personalized_params`` are their model's own parameter tensors, which
#: ``train`` ends by overwriting with the local weights w (so PFLlib tests
#: w as the personal model, where the paper and this project test theta).
GLOBAL_ONLY = ('pfedme',)
#: Those whose loop ends with what the next round would send (or whose
#: ``send_models`` would overwrite the clients' own models).
ENDS_SENT = (
  'local',  # its clients keep their own models (no send)
  'fedcac',
  'fedas',
  'fedproto',
  'fd',
  'fml',
  'fedmtl',
  'fedphp',
  'fedcross',
  'fedcross_most_similar',
  'fedpcl',
)
#: This project's settings that make its run the record's: FedPAC's server
#: pairs heads with clients through two random orders, fixed to the
#: identity in the record (``fixed_orders``): its combination in order.
OURS = {
  'fedpac': dict(head_assignment='in_order'),
  # PFLlib's pFedMeOptimizer decays theta by mu = 0.001 (not an argument)
  'pfedme': dict(weight_decay=0.001),
  # the Gumbel noise of FedCP's policy turned off on both sides (PFLlib's
  # ``gumbel_softmax`` replaced by the softmax it draws around)
  'fedcp': dict(gumbel=False),
  # PFLlib's regularizers without a gradient (see the modules' docstrings)
  'fedamp_pfllib': dict(detached=True),
  'fedmtl': dict(detached=True),
  # its schedule's H: PFLlib's -gr (global_rounds), its loop running H + 1
  'fedphp': dict(horizon=ROUNDS - 1),
  # the record fixes PFLlib's order of clients (``fixed_orders``): slot i
  # trains middleware model i on both sides
  'fedcross': dict(
    partner='least_similar', num_models=NUM_CLIENTS, shuffle=False
  ),
  'fedcross_most_similar': dict(
    partner='most_similar', num_models=NUM_CLIENTS, shuffle=False
  ),
  'fedkd': dict(horizon=ROUNDS - 1),
  'apple': dict(horizon=ROUNDS - 1),
}
#: FedCP's feature size (FedAvgCNN's ``fc1``).
FEATURES = 512


def fedcp_start():
  """FedCP's policy and context as both sides start them here (PFLlib
  draws them from torch): the policy as PyTorch initializes a ``Linear(D,
  2D)`` and a ``LayerNorm``, from a seeded generator, in this project's
  layout; the context uniform in [0, 1)."""
  rng = np.random.default_rng(7)
  bound = 1 / np.sqrt(FEATURES)
  draw = lambda *shape: rng.uniform(-bound, bound, shape).astype(np.float32)
  policy = {
    'kernel': draw(FEATURES, 2 * FEATURES),
    'bias': draw(2 * FEATURES),
    'scale': np.ones(2 * FEATURES, np.float32),
    'shift': np.zeros(2 * FEATURES, np.float32),
  }
  return policy, rng.uniform(0, 1, FEATURES).astype(np.float32)


def gpfl_start():
  """GPFL's class embeddings (PyTorch's ``nn.Embedding``: normal) and
  conditional valve (each ``Linear(D, D)`` uniform in +-1/sqrt(D), its
  ``LayerNorm`` 1 and 0) as both sides start them here, from a seeded
  generator, in this project's layout."""
  rng = np.random.default_rng(11)
  bound = 1 / np.sqrt(FEATURES)
  draw = lambda *shape: rng.uniform(-bound, bound, shape).astype(np.float32)
  gce = rng.normal(size=(NUM_CLASSES, FEATURES)).astype(np.float32)
  valve = {
    part: {
      'kernel': draw(FEATURES, FEATURES),
      'bias': draw(FEATURES),
      'scale': np.ones(FEATURES, np.float32),
      'shift': np.zeros(FEATURES, np.float32),
    }
    for part in ('gamma', 'beta')
  }
  return gce, valve


def _valve_layers(cov):
  return {'gamma': cov.Conditional_gamma, 'beta': cov.Conditional_beta}


def gpfl_set_start(torch, server):
  """Every GPFL client's embeddings (and their frozen copy) and valve set to
  ``gpfl_start``."""
  gce, valve = gpfl_start()
  for client in server.clients:
    with torch.no_grad():
      for module in (client.GCE, client.GCE_frozen):
        module.embedding.weight.copy_(torch.tensor(gce))
      for part, seq in _valve_layers(client.CoV).items():
        seq[0].weight.copy_(torch.tensor(valve[part]['kernel'].T))
        seq[0].bias.copy_(torch.tensor(valve[part]['bias']))
        seq[2].weight.copy_(torch.tensor(valve[part]['scale']))
        seq[2].bias.copy_(torch.tensor(valve[part]['shift']))


def gpfl_valve(cov):
  """A ``CoV``'s parameters in this project's layout."""
  return {
    part: {
      'kernel': seq[0].weight.detach().numpy().T,
      'bias': seq[0].bias.detach().numpy(),
      'scale': seq[2].weight.detach().numpy(),
      'shift': seq[2].bias.detach().numpy(),
    }
    for part, seq in _valve_layers(cov).items()
  }


def fedcp_set_start(torch, server):
  """Every FedCP client's policy and context set to ``fedcp_start``."""
  policy, context = fedcp_start()
  for client in server.clients:
    cs = client.model.gate.cs.fc
    with torch.no_grad():
      cs[0].weight.copy_(torch.tensor(policy['kernel'].T))
      cs[0].bias.copy_(torch.tensor(policy['bias']))
      cs[1].weight.copy_(torch.tensor(policy['scale']))
      cs[1].bias.copy_(torch.tensor(policy['shift']))
    client.context = torch.tensor(context)[None]


def fedamp_live(torch, server):
  """PFLlib's FedAMP clients with the proximal term live: the paper's
  lamda / (2 alphaK) ||w - u||^2 (Eq. 7) on the parameters themselves, not
  ``0.5 * lamda / alphaK * torch.norm`` of their ``.data`` (no gradient);
  the rest of ``clientAMP.train`` as it is."""

  def train(client):
    client.model.train()
    for _ in range(client.local_epochs):
      for x, y in client.load_train_data():
        loss = client.loss(client.model(x), y)
        gm = torch.cat([p.view(-1) for p in client.model.parameters()])
        pm = torch.cat([p.data.view(-1) for p in client.client_u.parameters()])
        strength = client.lamda / (2 * client.alphaK)
        loss = loss + strength * torch.sum((gm - pm) ** 2)
        client.optimizer.zero_grad()
        loss.backward()
        client.optimizer.step()

  for client in server.clients:
    client.train = types.MethodType(train, client)


def fedgen_labels(qualified, n):
  """FedGen's label draws made fixed on both sides: ``n`` labels spread
  over the sorted multiset of the population's labels (PFLlib's
  ``qualified_labels``) in place of ``np.random.choice`` (the test draws the
  same from the label counts)."""
  q = np.sort(np.asarray(qualified))
  return q[(np.arange(n) * len(q)) // n]


def fedgen_noise(n, dim):
  """FedGen's generator noise made fixed on both sides, in [0, 1): in
  place of ``torch.rand``."""
  rows, cols = np.arange(n)[:, None], np.arange(dim)[None, :]
  return ((rows * 7 + cols * 3) % 10 / 10).astype(np.float32)


def generator_state(generative):
  """PFLlib's ``Generative`` in this project's ``Generator`` layout (Flax
  names, [in, out] kernels)."""
  # copies: PyTorch's optimizer steps in place on what .numpy() shares
  sd = {
    k: v.detach().numpy().copy() for k, v in generative.state_dict().items()
  }
  return {
    'Dense_0/kernel': sd['fc1.0.weight'].T,
    'Dense_0/bias': sd['fc1.0.bias'],
    'BatchNorm_0/scale': sd['fc1.1.weight'],
    'BatchNorm_0/bias': sd['fc1.1.bias'],
    'Dense_1/kernel': sd['fc.weight'].T,
    'Dense_1/bias': sd['fc.bias'],
  }


def made_data(seed=0):
  """4 clients' train and test images [n, 16, 16, 1] and labels, each
  client's labels skewed to a few classes (a class-dependent mean, so
  that training moves the accuracy)."""
  rng = np.random.default_rng(seed)
  means = rng.normal(0, 1, (NUM_CLASSES, SIDE, SIDE, 1)).astype(np.float32)
  out = {}
  for i in range(NUM_CLIENTS):
    classes = rng.choice(NUM_CLASSES, 3, replace=False)
    for split, n in (('train', TRAIN), ('test', TEST)):
      y = rng.choice(classes, n).astype(np.int32)
      x = means[y] + rng.normal(0, 1, (n, SIDE, SIDE, 1)).astype(np.float32)
      out[f'{split}_x_{i}'] = x.astype(np.float32)
      out[f'{split}_y_{i}'] = y
  return out


def pcl_labels(data):
  """FedPCL's labels: the federation's classes numbered 0.. in order (PFLlib
  stops when a class is missing from a round's uploads while a client lacks
  it, as every class absent from this federation would be), and their
  number."""
  held = np.unique(
    np.concatenate([data[f'train_y_{i}'] for i in range(NUM_CLIENTS)])
  )
  renumber = np.full(NUM_CLASSES, -1, np.int32)
  renumber[held] = np.arange(len(held))
  out = {
    f'{split}_y_{i}': renumber[data[f'{split}_y_{i}']]
    for split in ('train', 'test')
    for i in range(NUM_CLIENTS)
  }
  return out, len(held)


def pcl_table(protos, num_classes):
  """A PFLlib prototype dict as (its rows in its keys' order, their
  classes, a class-indexed table, its classes)."""
  keyed = [(k, v) for k, v in protos.items() if not isinstance(v, list)]
  rows = np.stack([v.detach().numpy() for _, v in keyed])
  labels = np.asarray([k for k, _ in keyed], np.int32)
  table = np.zeros((num_classes, rows.shape[1]), np.float32)
  table[labels] = rows
  present = np.zeros(num_classes, bool)
  present[labels] = True
  return rows, labels, table, present


def stand_ins():
  """Modules PFLlib imports for what this run never does."""
  for name in ('h5py', 'matplotlib', 'matplotlib.pyplot'):
    try:
      __import__(name)
    except ImportError:
      sys.modules[name] = types.ModuleType(name)


#: The methods' arguments of PFLlib's ``main.py`` at its defaults (its
#: names): what a PFLlib run not given them computes with.
METHOD_DEFAULTS = dict(
  beta=0.0,
  tau=1.0,
  fine_tuning_epochs=10,
  momentum=0.1,
  kl_weight=0.0,
  server_learning_rate=1.0,
  lamda=1.0,
  mu=0.0,
  alpha=1.0,
  eta=1.0,
  rand_percent=80,
  layer_idx=2,
  alphaK=1.0,
  sigma=1.0,
  itk=4000,
  first_stage_bound=0,
  fedcross_alpha=0.99,
  collaberative_model_select_strategy=1,
  mentee_learning_rate=0.005,
  T_start=0.95,
  T_end=0.98,
  noise_dim=512,
  generator_learning_rate=0.005,
  hidden_dim=512,
  server_epochs=1000,
  localize_feature_extractor=False,
  dr_learning_rate=0.0,
  L=1.0,
  plocal_epochs=1,
  K=5,
  p_learning_rate=0.01,
)


def pfllib_args(torch, model, name, own, **sizes):
  """The ``args`` PFLlib's ``main.py`` hands a server: its defaults, the
  run's ``sizes`` (this record's unless given: ``batch_size``,
  ``local_learning_rate``, ``global_rounds``, ``num_clients``, ...), the
  algorithm's ``own`` settings, with ``model`` as its ``main.py`` builds it
  for ``name`` (this project's name)."""
  args = argparse.Namespace(
    device='cpu',
    dataset='made',
    num_classes=NUM_CLASSES,
    model=model,
    batch_size=TRAIN,
    local_learning_rate=LR,
    learning_rate_decay=False,
    learning_rate_decay_gamma=0.99,
    global_rounds=ROUNDS - 1,
    top_cnt=100,
    local_epochs=LOCAL_EPOCHS,
    algorithm=PFLLIB[name][0],
    join_ratio=1.0,
    random_join_ratio=False,
    num_clients=NUM_CLIENTS,
    prev=0,
    times=1,
    eval_gap=1,
    save_folder_name=tempfile.mkdtemp(),
    auto_break=False,
    dlg_eval=False,
    dlg_gap=100,
    batch_num_per_client=2,
    num_new_clients=0,
    fine_tuning_epoch_new=0,
    feature_dim=512,
    few_shot=0,
    client_drop_rate=0.0,
    train_slow_rate=0.0,
    send_slow_rate=0.0,
    time_select=False,
    goal='test',
    time_threthold=10000,
    **METHOD_DEFAULTS,
  )
  for k, v in {**sizes, **own}.items():
    setattr(args, k, v)
  if name in IDENTITY_HEAD:
    args.model.fc = torch.nn.Identity()
  if name in SPLIT:  # main.py: head = the model's fc, base the rest
    args.head = copy.deepcopy(args.model.fc)
    args.model.fc = torch.nn.Identity()
    from flcore.trainmodel.models import BaseHeadSplit

    args.model = BaseHeadSplit(args.model, args.head)
  return args


def pfllib_server(torch, name, model, own, **sizes):
  """PFLlib's server object for ``name`` (``pfllib_args``), its result
  files not written."""
  _, module, cls = PFLLIB[name]
  args = pfllib_args(torch, model, name, own, **sizes)
  server_cls = getattr(
    __import__(f'flcore.servers.{module}', fromlist=[cls]), cls
  )
  server = server_cls(args, 0)
  server.save_results = server.save_global_model = lambda: None  # no files
  # serveras.train ends by printing avg_generalization_metrics, which PFLlib
  # does not define at this commit
  server.avg_generalization_metrics = lambda: None
  return server, args


def fixed_orders(server):
  """A server whose client selection and upload sampling keep the clients
  in their order (its ``np.random.choice`` and ``random.sample`` draw
  permutations of every client at join ratio 1)."""

  def select():
    server.current_num_join_clients = len(server.clients)
    return list(server.clients)

  server.select_clients = select
  in_order = types.SimpleNamespace(sample=lambda seq, k: list(seq)[:k])
  for name in (type(server).__module__, 'flcore.servers.serverbase'):
    if hasattr(sys.modules[name], 'random'):
      sys.modules[name].random = in_order


def patch_reader(torch, client_arrays):
  """PFLlib's ``read_client_data`` returning ``client_arrays(idx,
  is_train) -> (x [n, H, W, C], y [n])`` as its own does: a list of
  (x [C, H, W], y) tensor pairs."""

  def read(dataset, idx, is_train=True, few_shot=0):
    x, y = client_arrays(idx, is_train)
    x = torch.tensor(x).permute(0, 3, 1, 2)
    return list(zip(x, torch.tensor(y).long()))

  import flcore.clients.clientbase as clientbase
  import flcore.servers.serverbase as serverbase
  import utils.data_utils as data_utils

  # and in the modules that import it later (servercp.py)
  data_utils.read_client_data = read
  clientbase.read_client_data = read
  serverbase.read_client_data = read


def to_flax(torch, state, template_model, sample_x):
  """A FedAvgCNN state dict in this project's ``pfllib_cnn`` layout."""
  from fedjax_personal.models import weights

  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, 'w.pt')
    torch.save({k: v.detach().clone() for k, v in state.items()}, path)
    return weights.flat_params(weights.load(path, template_model, sample_x))


def project(flat):
  """Each leaf of a flat parameter dict as its projections on PROJECTIONS
  fixed random unit directions (seeded by the leaf's size): [PROJECTIONS]."""
  out = {}
  for k, v in flat.items():
    v = np.asarray(v, np.float64).ravel()
    dirs = np.random.default_rng(v.size).normal(size=(PROJECTIONS, v.size))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    out[k] = (dirs @ v).astype(np.float64)
  return out


def wide_head(client):
  """A FedGC client's classifier (PFLlib's ``Linear(D, classes it has,
  bias=False)``) as a [D, C] kernel, zero in the columns of the classes it
  lacks."""
  w = client.model.head.weight.detach().numpy()
  out = np.zeros((w.shape[1], NUM_CLASSES), np.float32)
  out[:, client.classes_index.numpy()] = w.T
  return out


def whole_state(model):
  """A model's state dict under FedAvgCNN's names (a BaseHeadSplit's
  ``base.`` / ``head.`` prefixes mapped back)."""
  return whole_state_of(model.state_dict())


def whole_state_of(state):
  """``whole_state`` of a state dict."""
  out = {}
  for k, v in state.items():
    if k.startswith('base.'):
      k = k[len('base.') :]
    elif k.startswith('head.'):
      k = 'fc.' + k[len('head.') :]
    out[k] = v
  return out


def _arrays(data, labels, i, is_train):
  """Client ``i``'s images from ``data`` and its labels from ``labels``."""
  split = 'train' if is_train else 'test'
  return data[f'{split}_x_{i}'], labels[f'{split}_y_{i}']


def run(torch, name, data, init_state, template, sample_x):
  """One algorithm's rounds in PFLlib's code; its record."""
  from flcore.trainmodel.models import FedAvgCNN

  torch.manual_seed(0)
  model = FedAvgCNN(in_features=1, num_classes=NUM_CLASSES, dim=DIM)
  model.load_state_dict(init_state)
  rec, sizes = {}, {}
  if name == 'fedpcl':  # its labels renumbered over the classes held
    labels, sizes['num_classes'] = pcl_labels(data)
    rec.update({f'{name}/{k}': v for k, v in labels.items()})
    rec[f'{name}/num_classes'] = np.asarray(sizes['num_classes'])
    patch_reader(torch, lambda i, train: _arrays(data, labels, i, train))
  server, args = pfllib_server(torch, name, model, ALGORITHMS[name], **sizes)
  fixed_orders(server)
  gumbel = torch.nn.functional.gumbel_softmax
  if name == 'gpfl':
    gpfl_set_start(torch, server)
  if name == 'fedamp':
    fedamp_live(torch, server)
  if name == 'fedcp':
    fedcp_set_start(torch, server)
    torch.nn.functional.gumbel_softmax = (
      lambda logits, tau=1, hard=False, dim=-1: torch.softmax(logits / tau, dim)
    )
  if name == 'fedkd':  # each client's feature map as PyTorch drew it
    for i, client in enumerate(server.clients):
      rec[f'{name}/init_w_h_{i}'] = client.W_h.weight.detach().numpy().copy()
  if name == 'fedgc':  # each client's classifier as drawn, over its classes
    for i, client in enumerate(server.clients):
      rec[f'{name}/init_head_{i}'] = wide_head(client)
  rand, choice = torch.rand, np.random.choice
  if name == 'fedgen':  # its draws fixed (both sides), its generator as drawn
    np.random.choice = lambda a, size: fedgen_labels(a, size)
    torch.rand = lambda size, device=None: torch.tensor(fedgen_noise(*size))
    for k, v in generator_state(server.generative_model).items():
      rec[f'{name}/generator_init/{k}'] = v
  loader = None
  if name == 'fedpcl':  # the loaders in the examples' order (both sides)
    import flcore.clients.clientbase as clientbase

    loader = clientbase.DataLoader
    clientbase.DataLoader = lambda *a, **k: loader(
      *a, **{**k, 'shuffle': False}
    )
  if name == 'fedbabu':
    # serverbabu.train's rounds, recorded after the last aggregation, then
    # its end: the clients train once more (the loop's last pass) and
    # fine-tune (``fine_tune``).
    for _ in range(ROUNDS):
      server.selected_clients = list(server.clients)
      server.send_models()
      for client in server.selected_clients:
        client.train()
      server.receive_models()
      server.aggregate_parameters()
    server.send_models()
    for client in server.clients:
      client.train()
      client.fine_tune()
  else:
    server.train()  # its own loop: global_rounds + 1 = ROUNDS rounds
    if name == 'fedala':  # each client's trained model, before its next ALA
      for i, client in enumerate(server.clients):
        own = to_flax(torch, whole_state(client.model), template, sample_x)
        for k, v in project(own).items():
          rec[f'{name}/client_{i}/{k}'] = v
    if name not in ENDS_SENT:  # (FedPAC's: the global body, own heads)
      server.send_models()  # the last aggregate, as the next round would
  if name == 'fedbabu':
    body = dict(server.global_model.state_dict())
    body['fc.weight'] = args.head.weight
    body['fc.bias'] = args.head.bias
    glob = body
  elif name == 'fedgc':  # the global body; each client's classifier
    glob = dict(server.global_model.state_dict())
    glob['fc.weight'] = torch.zeros(NUM_CLASSES, 512)
    glob['fc.bias'] = torch.zeros(NUM_CLASSES)
    for i, client in enumerate(server.clients):
      rec[f'{name}/head_{i}'] = wide_head(client)
  elif name in ('fedgh', 'pflda'):  # the global head, each client's model
    glob = None
    top = server.head if name == 'fedgh' else server.global_model
    rec[f'{name}/head/kernel'] = top.weight.detach().numpy().T
    rec[f'{name}/head/bias'] = top.bias.detach().numpy()
  elif name == 'fedkd':  # the compressed global mentee, as clients get it
    glob = whole_state_of(
      {
        k: torch.tensor(np.asarray(v))
        for k, v in server.compressed_param.items()
      }
    )
  elif name in (
    'fedpac',
    'fedamp',
    'fedamp_pfllib',
    'fedmtl',
    'fedpcl',
    'apple',
    'local',
    'fedper',
    'fedrep',
    'lg_fedavg',
  ):
    glob = None  # FedPAC's is the body alone; the others keep none
  elif name in ('fedcp', 'gpfl'):  # the global body, as a zero head's model
    base = server.global_modules if name == 'fedcp' else server.global_model
    glob = dict(base.state_dict())
    glob['fc.weight'] = torch.zeros(NUM_CLASSES, FEATURES)
    glob['fc.bias'] = torch.zeros(NUM_CLASSES)
  else:
    glob = whole_state(server.global_model)
  if name == 'fedcp':  # each client's heads, policy and context
    for i, client in enumerate(server.clients):
      for part, top in (
        ('head', client.model.model.head),
        ('head_g', client.model.head_g),
      ):
        rec[f'{name}/{part}_{i}/kernel'] = top.weight.detach().numpy().T
        rec[f'{name}/{part}_{i}/bias'] = top.bias.detach().numpy()
      cs = client.model.gate.cs.fc
      policy = {
        'kernel': cs[0].weight.detach().numpy().T,
        'bias': cs[0].bias.detach().numpy(),
        'scale': cs[1].weight.detach().numpy(),
        'shift': cs[1].bias.detach().numpy(),
      }
      for k, v in project(policy).items():
        rec[f'{name}/policy_{i}/{k}'] = v
      rec[f'{name}/context_{i}'] = client.context.detach().numpy().ravel()
  if name == 'gpfl':  # the global embeddings and valve; heads and inputs
    rec[f'{name}/gce'] = project(
      {'gce': server.GCE.embedding.weight.detach().numpy()}
    )['gce']
    flat = {
      f'{part}/{k}': v
      for part, layer in gpfl_valve(server.CoV).items()
      for k, v in layer.items()
    }
    for k, v in project(flat).items():
      rec[f'{name}/valve/{k}'] = v
    for i, client in enumerate(server.clients):
      rec[f'{name}/head_{i}/kernel'] = (
        client.model.head.weight.detach().numpy().T
      )
      rec[f'{name}/head_{i}/bias'] = client.model.head.bias.detach().numpy()
      rec[f'{name}/personal_{i}'] = (
        client.personalized_conditional_input.numpy()
      )
      rec[f'{name}/generic_{i}'] = client.generic_conditional_input.numpy()
  if name in ('fedproto', 'fd'):  # no global model: the global table
    glob = None
    table = server.global_protos if name == 'fedproto' else server.global_logits
    width = FEATURES if name == 'fedproto' else NUM_CLASSES
    out = np.zeros((NUM_CLASSES, width), np.float32)
    present = np.zeros(NUM_CLASSES, bool)
    for label, value in table.items():
      if not isinstance(value, list):
        out[label], present[label] = value.detach().numpy(), True
    rec[f'{name}/table'], rec[f'{name}/present'] = out, present
  if name in OWN_MODELS and name != 'fedala':  # each client's model
    for i, client in enumerate(server.clients):
      mine = client.model_per if name == 'ditto' else client.model
      state = whole_state(mine)
      if name in IDENTITY_HEAD:  # its body, under a zero fc
        state['fc.weight'] = torch.zeros(NUM_CLASSES, FEATURES)
        state['fc.bias'] = torch.zeros(NUM_CLASSES)
      own = to_flax(torch, state, template, sample_x)
      for k, v in project(own).items():
        rec[f'{name}/client_{i}/{k}'] = v
  if glob is not None:
    for k, v in project(to_flax(torch, glob, template, sample_x)).items():
      rec[f'{name}/global/{k}'] = v
  if name == 'fedrod':
    for i, client in enumerate(server.clients):
      rec[f'{name}/head_{i}/kernel'] = client.head.weight.detach().numpy().T
      rec[f'{name}/head_{i}/bias'] = client.head.bias.detach().numpy()
  if name.startswith('fedcross'):  # the middleware models
    for m, mw in enumerate(server.w_locals):
      own = to_flax(torch, mw.state_dict(), template, sample_x)
      for k, v in project(own).items():
        rec[f'{name}/middleware_{m}/{k}'] = v
  if name == 'fedphp':  # each client's inherited private model
    for i, client in enumerate(server.clients):
      private = to_flax(torch, whole_state(client.model_p), template, sample_x)
      for k, v in project(private).items():
        rec[f'{name}/private_{i}/{k}'] = v
  if name == 'apple':  # each client's directed relationship vector
    for i, client in enumerate(server.clients):
      rec[f'{name}/ps_{i}'] = np.asarray(client.ps, np.float64)
  if name == 'feddbe':
    for i, client in enumerate(server.clients):
      rec[f'{name}/bias_{i}'] = client.client_mean.detach().numpy()
  if name == 'fedgen':
    for k, v in generator_state(server.generative_model).items():
      rec[f'{name}/generator/{k}'] = v
  if name == 'fedpcl':  # the global prototypes and each client's (padded)
    k = server.num_classes
    rows, keys, _, _ = pcl_table(server.global_protos, k)
    rec[f'{name}/global'], rec[f'{name}/global_labels'] = rows, keys
    for i, client in enumerate(server.clients):
      _, _, table, present = pcl_table(client.protos, k)
      rec[f'{name}/protos_{i}'], rec[f'{name}/present_{i}'] = table, present
    clientbase.DataLoader = loader
  correct = []
  for client in server.clients:
    if name == 'ditto':  # tested on their personal models
      acc, num = client.test_metrics_personalized()[:2]
    else:
      acc, num, _ = client.test_metrics()
    correct.append(acc)
  rec[f'{name}/test_correct'] = np.asarray(correct, np.int32)
  if name == 'fedpcl':
    patch_reader(torch, lambda i, train: _arrays(data, data, i, train))
  torch.nn.functional.gumbel_softmax = gumbel
  torch.rand, np.random.choice = rand, choice
  return rec


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--pfllib', required=True, help="PFLlib's system/ folder")
  parser.add_argument('--out', required=True)
  parser.add_argument(
    '--only', default='', help='Algorithms to record again (default: all).'
  )
  a = parser.parse_args()
  import torch

  sys.path.insert(0, os.path.abspath(a.pfllib))
  stand_ins()
  from flcore.trainmodel.models import FedAvgCNN

  from fedjax_personal import models

  data = made_data()
  patch_reader(torch, lambda i, train: _arrays(data, data, i, train))
  sample_x = data['train_x_0'][:1]
  template = models.create_model(
    'pfllib_cnn', NUM_CLASSES, sample_x, init='pytorch'
  )
  torch.manual_seed(0)
  init = FedAvgCNN(in_features=1, num_classes=NUM_CLASSES, dim=DIM).state_dict()
  init = {k: v.clone() for k, v in init.items()}
  record = dict(data)
  record['pfllib_commit'] = np.asarray(PFLLIB_COMMIT)
  for k, v in to_flax(torch, init, template, sample_x).items():
    record[f'init/{k}'] = v
  only = a.only.split(',') if a.only else list(ALGORITHMS)
  if a.only:  # the other algorithms' records kept as they are
    with np.load(a.out) as f:
      record.update({k: f[k] for k in f.files if k.split('/')[0] not in only})
  for name in only:
    record.update(run(torch, name, data, init, template, sample_x))
    print(name, record[f'{name}/test_correct'])
  np.savez_compressed(a.out, **record)
  print('wrote', a.out)


if __name__ == '__main__':
  main()

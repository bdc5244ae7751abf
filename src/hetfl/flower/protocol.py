"""The messages between hetfl's ServerApp and ClientApp: kinds and record names.

Every message carries a ``ConfigRecord`` named :data:`HEADER` with the run's resolved hetfl
config (TOML text, so a node needs nothing but the message and its own data), the client it
is for, the round, and the bookkeeping of client state (see :mod:`hetfl.flower.node`).
Tensors travel in ``ArrayRecord`` s (:mod:`hetfl.flower.codec`). Under ``runtime.secure_aggregation``
an additive post-hoc step runs as Flower's SecAgg+ (:mod:`hetfl.flower.secagg`), whose messages
carry a legacy FitIns / FitRes and SecAgg+'s own config record instead.

=================  =============================  =====================================
message type       server -> node                 node -> server
=================  =============================  =====================================
``query.hello``    (header)                       partition-id, num-partitions
``query.setup``    shared                         ``reply``: ``setup_query``'s tensors
``train``          payload, init, shared          ``upload``; steps, loss, samples
``train``          SecAgg+'s four stages; at      stage 2: the step's dense reply
(SecAgg+)          stage 2 a FitIns: header,      in fixed point, masked; the server
                   model (:mod:`.secagg`)         sees only the sum
``query.posthoc``  model (global, raw)            ``reply``: the step's ``client_query``
``evaluate``       server.model/extra, payload,   accuracy on the client's test split
                   init, shared
=================  =============================  =====================================

Every reply to a message for a client (all but ``query.hello`` and SecAgg+'s) also carries a
``ConfigRecord`` named :data:`DATA` with the digest of the samples the node holds for that client
(:func:`hetfl.flower.codec.client_data_digest`); the server refuses a reply whose digest differs from
its own (the node's ``data-root`` holds other data).
"""

from __future__ import annotations

HELLO = "query.hello"
SETUP = "query.setup"
TRAIN = "train"
POSTHOC = "query.posthoc"
EVALUATE = "evaluate"

HEADER = "hetfl"  # ConfigRecord: config, run, session, client, round, ...
PAYLOAD = "payload"  # Algorithm.payload(server, client)
INIT = "init"  # Algorithm.init_client_state(client, server), for a client whose node has no state yet
SHARED = "shared"  # the server's shared/<name> tensors (FedMix's averaged data), sent once per node
MODEL = "model"  # the global model a post-hoc step's client query runs on
VIEW_MODEL = "server.model"  # the server state entries client_model reads (evaluation on the node)
VIEW_EXTRA = "server.extra"
UPLOAD = "upload"
REPLY = "reply"
RESULT = "result"  # MetricRecord of a reply's numbers
DATA = "data"  # ConfigRecord of every reply to a client's message: ``digest``, of the client's samples on the node
LOSS_PART = "loss-part/"  # a RESULT key's prefix: a part of the local loss summed over the steps (``ce``, ...)

NODES_DIR = "flower_nodes"  # simulation: the nodes' client-state store inside the run directory
#: environment variable listing (os.pathsep-separated) the folders under which a node without a state-dir of its
#: own may keep client state where the server's ``state-root`` says (the simulation sets it: hetfl.flower.node)
TRUSTED_ROOTS_ENV = "HETFL_TRUSTED_STATE_ROOTS"
#: environment variable listing (os.pathsep-separated) the plug-in files (``--plugin FILE``) a simulated node loads
#: before it builds its experiment: the methods they register are the server's (the simulation sets it)
PLUGINS_ENV = "HETFL_PLUGIN_FILES"

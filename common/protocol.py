"""Names of the records and keys in the messages between the ServerApp and the ClientApp. A method's own keys
live in its file (strategies/)."""

# Records of a message's RecordDict: the model (or the update) as one flat array, a strategy's extra
# tensors (both ways; absent when there are none), the config, the reply's metrics.
ARRAYS, EXTRAS, CONFIG, METRICS = "arrays", "extras", "config", "metrics"

# Keys of a train reply's metrics (besides the training metrics themselves).
NUM_EXAMPLES, PARTITION_ID, BASE_VERSION = "num-examples", "partition-id", "base-version"
REPLY_KEYS = (NUM_EXAMPLES, PARTITION_ID, BASE_VERSION)

# Keys of a message's config (besides the data spec, the model spec and the local recipe, which carry their own):
# the model version, the seed of a train message's local run, and the strategy (``Strategy.reference()``: a node
# runs its client side, and imports a user's own first).
VERSION, TRAIN_SEED, STRATEGY = "version", "train-seed", "strategy"
# ... and of a train message's: how many updates of this run were dispatched to its client before it (a device's
# state across its updates, e.g. topk's residual, is missing only if this is 0: client_app/wire_codec.py)
UPDATES_BEFORE = "updates-before"
# ... and, with ``model-difference``, the digest of the model the message's difference applies to ("": the message
# carries the whole model; absent: the device's copy is not touched, as by an evaluate message)
MODEL_BASE = "model-base"

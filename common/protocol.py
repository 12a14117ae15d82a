"""Names of the records and keys in the messages between the ServerApp and the ClientApp."""

# Records of a message's RecordDict: the model (or the update) as one flat array, a strategy's extra
# tensors (both ways; absent when there are none), the config, the reply's metrics.
ARRAYS, EXTRAS, CONFIG, METRICS = "arrays", "extras", "config", "metrics"

# Keys of a train reply's metrics (besides the training metrics themselves).
NUM_EXAMPLES, PARTITION_ID, BASE_VERSION = "num-examples", "partition-id", "base-version"
REPLY_KEYS = (NUM_EXAMPLES, PARTITION_ID, BASE_VERSION)

# Keys of a train message's config (besides the local recipe and the data spec).
VERSION, TRAIN_SEED, MODEL = "version", "train-seed", "model"

# Key of an evaluate message's config: epochs the client fine-tunes the received model on its own training
# data before it evaluates (FedAvg+); absent or 0: evaluate the model as received.
FINETUNE_EPOCHS = "finetune-epochs"

# Key of a payload's extra array: more models the client may start from (IFCA's cluster models after the
# message's own). The client loads the one with the lowest loss on its training data, trains or
# evaluates it, and names it in its reply's metrics (0 = the message's model).
CANDIDATES, CANDIDATE = "candidates", "candidate"

# Keys of FedEM's extra arrays: the payload's other components and the client's mixture weights π (the
# message's model is component 1); the reply's deltas of the other components and the new π.
COMPONENTS, MIXTURE, COMPONENT_DELTAS = "components", "mixture", "component-deltas"

# FedDUAL's code (dynamic-source = loss-gradient): a train message's config asks for the gradient of the summed
# cross-entropy over the client's whole training data, at its trained model, w.r.t. its last this-many parameter
# arrays; the reply carries it (flat) as the extra array of the same name.
LOSS_GRADIENT = "loss-gradient"

# Data mixing: a payload's central examples (images and labels, as floats) that the client trains on with its own
# data this round (example transfer), and the central gradient it adds to every local step (gradient transfer).
CENTRAL_X, CENTRAL_Y, CENTRAL_GRADIENT = "central-x", "central-y", "central-gradient"

"""The device's half of the wire's codecs (common/codecs.py), as a Flower mod: ``ClientApp(mods=[codec_mod])``.

On the way in, a message whose model travelled encoded (``model-codec`` in its config) is decoded to the float32
array every handler reads; on the way out, a train reply's update is encoded as ``update-codec`` says. Handlers
never see a codec, so every method's client side works unchanged; a Flower user's own ClientApp gets the same by
adding the mod (its messages' configs carry the keys: hybridfl's ``client_config``).

``topk``'s error feedback keeps the residual e on the device, per run: in Flower's ``Context.state`` (across the
node's messages, in every runtime) and, where the node keeps a cache folder (client_app/node_cache.py: by default
it does), in ``<cache-dir>/run-<run id>/residual-<partition>.npy``, so that it survives a restart of the device's
processes. A device that finds neither while its message says earlier updates were dispatched to it
(``updates-before``) logs that its residual is lost, starts again from zero and says so in the reply's metrics
(``residual-lost`` = 1): what it had not sent is gone, the run goes on.
"""

from __future__ import annotations

from logging import WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import log

from client_app.node_cache import cache_dir
from common.codecs import PLAIN, WIRE_KEY, WireCodecs, decode, encode
from common.config import make_options
from common.protocol import ARRAYS, CONFIG, METRICS, PARTITION_ID, UPDATES_BEFORE

RESIDUAL = "wire-residual"  # Context.state's record of topk's residual
LOST = "residual-lost"  # the train reply's metric when it was lost


def codec_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Decode the message's model as its ``model-codec`` says, run the handler, encode a train reply's update as its
    ``update-codec`` says (topk with this node's residual)."""
    if CONFIG not in msg.content.config_records:
        return call_next(msg, context)
    config = msg.content[CONFIG]
    codecs = make_options(WireCodecs, config)
    if codecs == PLAIN:
        return call_next(msg, context)
    if codecs.model_codec != "none" and ARRAYS in msg.content.array_records:
        record = msg.content[ARRAYS]
        numel = int(np.prod(record[WIRE_KEY].shape)) if WIRE_KEY in record else 0
        flat = decode(record, codecs.model_codec, numel, codecs)
        msg.content[ARRAYS] = ArrayRecord({WIRE_KEY: Array(flat)})
    reply = call_next(msg, context)
    if (codecs.update_codec == "none" or msg.metadata.message_type != MessageType.TRAIN or reply.has_error()
            or ARRAYS not in reply.content.array_records):
        return reply
    update = reply.content[ARRAYS][WIRE_KEY].numpy()
    residual, path = None, None
    if codecs.update_codec == "topk":
        path = _residual_file(context, msg.metadata.run_id, int(reply.content[METRICS][PARTITION_ID]))
        residual = _load(context, path, update.size)
        if residual is None and int(config.get(UPDATES_BEFORE, 0)) > 0:
            log(WARNING, "this device's topk residual for run %d is lost (no state, no file%s): what it had not "
                "sent is gone; starting again from zero", msg.metadata.run_id, f" at {path}" if path else "")
            reply.content[METRICS][LOST] = 1
    record, residual = encode(update, codecs.update_codec, codecs, residual)
    reply.content[ARRAYS] = record
    if residual is not None:
        context.state[RESIDUAL] = ArrayRecord({WIRE_KEY: Array(residual)})
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.stem}.partial.npy")
            np.save(partial, residual, allow_pickle=False)
            partial.replace(path)  # whole or not at all: a kill mid-write leaves the last one
    return reply


def encoded(msg: Message) -> bool:
    """Whether `msg`'s model, or its reply's update, travels encoded: it must go through :func:`codec_mod`."""
    if CONFIG not in msg.content.config_records:
        return False
    return make_options(WireCodecs, msg.content[CONFIG]) != PLAIN


def _residual_file(context: Context, run_id: int, partition: int) -> Path | None:
    folder = cache_dir(context.node_config)
    return None if folder is None else folder / f"run-{run_id}" / f"residual-{partition}.npy"


def _load(context: Context, path: Path | None, numel: int) -> np.ndarray | None:
    """The node's residual of `numel` values: Context.state's, else its file's, else None."""
    if RESIDUAL in context.state.array_records:
        kept = context.state[RESIDUAL][WIRE_KEY].numpy()
        if kept.size == numel:
            return np.array(kept, dtype=np.float32)
    if path is not None and path.is_file():
        try:
            kept = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            log(WARNING, "the topk residual file %s does not load (%s)", path, err)
            return None
        if kept.shape == (numel,):
            return np.array(kept, dtype=np.float32)
    return None

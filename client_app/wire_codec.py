"""The device's half of the wire's codecs (common/codecs.py), as a Flower mod: ``ClientApp(mods=[codec_mod])``.

On the way in, a message whose model travelled encoded (``model-codec`` in its config) is decoded to the float32
array every handler reads; on the way out, a train reply's update is encoded as ``update-codec`` says. Handlers
never see a codec, so every method's client side works unchanged; a Flower user's own ClientApp gets the same by
adding the mod (its messages' configs carry the keys: hybridfl's ``client_config``).

The top-k codecs' error feedback keeps the residual e on the device, per run: in Flower's ``Context.state`` (across
the node's messages, in every runtime) and, where the node keeps a cache folder (client_app/node_cache.py: by
default it does), in ``<cache-dir>/run-<run id>/residual-<partition>.npy``, so that it survives a restart of the
device's processes. A device that finds neither while its message says earlier updates were dispatched to it
(``updates-before``) logs that its residual is lost, starts again from zero and says so in the reply's metrics
(``residual-lost`` = 1, else 0): what it had not sent is gone, the run goes on.

With ``model-difference``, a train message carries the difference from the model the device holds, named by its
digest (``model-base``); the device keeps the model it trains from the same two ways (``model-<partition>.npy``).
A device that no longer holds the model named replies with an error saying so, and its next message carries the
whole model.
"""

from __future__ import annotations

from logging import WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import log
from flwr.common.constant import ErrorCode

from client_app.node_cache import cache_dir
from common.codecs import PLAIN, SPARSE, WIRE_KEY, WireCodecs, apply_difference, encode, model_digest
from common.config import make_options
from common.protocol import ARRAYS, CONFIG, METRICS, MODEL_BASE, PARTITION_ID, UPDATES_BEFORE

RESIDUAL = "wire-residual"  # Context.state's record of topk's residual
HELD = "wire-model"  # ... and of the model a model-difference applies to
LOST = "residual-lost"  # the train reply's metric when it was lost


def codec_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Decode the message's model as its ``model-codec`` says, run the handler, encode a train reply's update as its
    ``update-codec`` says (a top-k codec with this node's residual)."""
    if CONFIG not in msg.content.config_records:
        return call_next(msg, context)
    config = msg.content[CONFIG]
    codecs = make_options(WireCodecs, config)
    if codecs == PLAIN:
        return call_next(msg, context)
    if codecs.model_codec != "none" and ARRAYS in msg.content.array_records:
        held, path = None, _kept_file(context, msg.metadata.run_id, "model", _partition(context))
        if base := str(config.get(MODEL_BASE, "")):
            held = _load(context, HELD, path)
            if held is None or model_digest(held) != base:
                reason = (f"this device no longer holds the model {base} that the message's difference applies to "
                          f"({'it holds none' if held is None else 'it holds ' + model_digest(held)})")
                log(WARNING, "%s; its next message carries the whole model", reason)
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
        flat = apply_difference(held, msg.content[ARRAYS], codecs)
        if MODEL_BASE in config:
            _keep(context, HELD, path, flat)
        msg.content[ARRAYS] = ArrayRecord({WIRE_KEY: Array(flat)})
    reply = call_next(msg, context)
    if (codecs.update_codec == "none" or msg.metadata.message_type != MessageType.TRAIN or reply.has_error()
            or ARRAYS not in reply.content.array_records):
        return reply
    update = reply.content[ARRAYS][WIRE_KEY].numpy()
    residual, path = None, None
    if codecs.update_codec in SPARSE:
        path = _kept_file(context, msg.metadata.run_id, "residual", int(reply.content[METRICS][PARTITION_ID]))
        residual = _load(context, RESIDUAL, path, update.size)
        lost = residual is None and int(config.get(UPDATES_BEFORE, 0)) > 0
        if lost:
            log(WARNING, "this device's top-k residual for run %d is lost (no state, no file%s): what it had not "
                "sent is gone; starting again from zero", msg.metadata.run_id, f" at {path}" if path else "")
        # 0 too, so that the run's mean of it (train-residual-lost) is the share of a step's updates that lost one
        reply.content[METRICS][LOST] = int(lost)
    record, residual = encode(update, codecs.update_codec, codecs, residual)
    reply.content[ARRAYS] = record
    if residual is not None:
        _keep(context, RESIDUAL, path, residual)
    return reply


def encoded(msg: Message) -> bool:
    """Whether `msg`'s model, or its reply's update, travels encoded: it must go through :func:`codec_mod`."""
    if CONFIG not in msg.content.config_records:
        return False
    return make_options(WireCodecs, msg.content[CONFIG]) != PLAIN


def _partition(context: Context) -> int | None:
    return int(context.node_config["partition-id"]) if "partition-id" in context.node_config else None


def _kept_file(context: Context, run_id: int, what: str, partition: int | None) -> Path | None:
    """Where the node keeps `what` for a partition across restarts of its processes (None: it keeps no files)."""
    folder = cache_dir(context.node_config)
    return None if folder is None or partition is None else folder / f"run-{run_id}" / f"{what}-{partition}.npy"


def _keep(context: Context, key: str, path: Path | None, values: np.ndarray) -> None:
    """Keep `values` in Context.state under `key` and, where the node keeps files, at `path`."""
    context.state[key] = ArrayRecord({WIRE_KEY: Array(values)})
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.partial.npy")
        np.save(partial, values, allow_pickle=False)
        partial.replace(path)  # whole or not at all: a kill mid-write leaves the last one


def _load(context: Context, key: str, path: Path | None, numel: int | None = None) -> np.ndarray | None:
    """What the node kept under `key` (of `numel` values, where given): Context.state's, else its file's, else
    None."""
    if key in context.state.array_records:
        kept = context.state[key][WIRE_KEY].numpy()
        if numel is None or kept.size == numel:
            return np.array(kept, dtype=np.float32)
    if path is not None and path.is_file():
        try:
            kept = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            log(WARNING, "the file %s does not load (%s)", path, err)
            return None
        if kept.ndim == 1 and (numel is None or kept.size == numel):
            return np.array(kept, dtype=np.float32)
    return None

"""The wire's codecs (common/codecs.py) and the device's mod (client_app/wire_codec.py): each round trip within the
error its arithmetic allows, its bytes on the wire, topk's error feedback across messages and across a restart of
the device's process, every malformed record refused naming why, and a pairing a method cannot use refused at
start."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message import make_message

from client_app.wire_codec import HELD, LOST, RESIDUAL, codec_mod
from common.codecs import (
    COUNT_KEY,
    HALF_MAX,
    INDEX_BLOCK,
    INDEX_KEY,
    SCALE_KEY,
    UPDATE_CODECS,
    WIRE_KEY,
    BadArrays,
    WireCodecs,
    apply_difference,
    decode,
    encode,
    encode_model,
    encoded_nbytes,
    model_digest,
    topk_count,
)
from common.config import ConfigError, options_dict
from common.params import ParamSpec
from common.protocol import ARRAYS, CONFIG, METRICS, MODEL_BASE, PARTITION_ID, UPDATES_BEFORE
from flower_internals.wire import wire_bytes
from hybridfl.cli import main
from server_app.config import make_config
from server_app.wire import Dispatcher
from strategies.base import Payload

EPS = 2.0**-24  # float32's unit roundoff
N = 10_000 + 37  # not a multiple of a block


def vector(seed: int = 0, n: int = N) -> np.ndarray:
    """Values over many scales (an update's layers differ by orders of magnitude), a zero block, tiny values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2, n)).astype(np.float32)
    x[256:512] = 0.0
    x[600:700] = 1e-30
    return x


def test_none_and_fp16_round_trips_within_halfs_rounding():
    x, wire = vector(), WireCodecs()
    record, residual = encode(x, "none", wire)
    assert residual is None and np.array_equal(decode(record, "none", N, wire), x)
    back = decode(encode(x, "fp16", wire)[0], "fp16", N, wire)
    # half has 11 significant bits: a relative error of 2^-11 in its normal range, 2^-25 absolute below it
    assert (np.abs(back - x) <= np.maximum(2.0**-11 * np.abs(x), 2.0**-25)).all()
    assert not np.array_equal(back, x)  # it does round


def test_int8_round_trip_within_half_a_step_of_each_blocks_scale():
    wire = WireCodecs(int8_block=64)
    x = vector(1)
    record, _ = encode(x, "int8", wire)
    q, scale = record[WIRE_KEY].numpy(), record[SCALE_KEY].numpy()
    assert q.dtype == np.int8 and q.shape == (N,) and scale.shape == (-(-N // 64),) and q.min() >= -127
    back = decode(record, "int8", N, wire)
    step = np.repeat(scale, 64)[:N]
    # q = rint(x/s) in float32 (x/s off by ≤ 127 EPS), then q·s rounded (≤ 127 s EPS): |x̂ − x| ≤ s (1/2 + 254 EPS)
    assert (np.abs(back - x) <= step * (0.5 + 254 * EPS)).all()
    blocks = np.pad(x, (0, -N % 64)).reshape(-1, 64)
    np.testing.assert_allclose(scale, np.abs(blocks).max(axis=1) / 127, rtol=2 * EPS)
    assert (back[256:512] == 0).all()  # a zero block stays zero (its scale is 0)


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3])
def test_topk_sends_the_largest_entries_and_keeps_the_rest_as_its_residual(fraction):
    wire, x = WireCodecs(topk_fraction=fraction), vector(2)
    k = topk_count(N, fraction)
    record, residual = encode(x, "topk", wire)
    index = record[INDEX_KEY].numpy()
    assert index.dtype == np.int32 and len(index) == k and (np.diff(index) > 0).all()
    back = decode(record, "topk", N, wire)
    assert np.count_nonzero(back) <= k and np.array_equal(back[index], x[index])
    assert np.abs(x[index]).min() >= np.abs(np.delete(x, index)).max()  # the k largest by magnitude
    assert np.array_equal(back + residual, x)  # disjoint: what is not sent is kept, exactly


@pytest.mark.parametrize("n", [N, 3 * INDEX_BLOCK + 5])
def test_topk16_sends_topks_entries_in_half_its_bytes_and_keeps_its_rounding_in_the_residual(n):
    """The same k entries as topk (one block, and several: the 16-bit index counts inside its block); each value
    within half's rounding of v / s (s the largest kept magnitude) and float32's; the residual is x less what the
    server decodes, bit for bit."""
    wire, x = WireCodecs(topk_fraction=0.01), vector(2, n)
    k = topk_count(n, 0.01)
    record, residual = encode(x, "topk16", wire)
    index = encode(x, "topk", wire)[0][INDEX_KEY].numpy()
    assert record[INDEX_KEY].numpy().dtype == np.uint16 and record[WIRE_KEY].numpy().dtype == np.float16
    blocks = np.bincount(index // INDEX_BLOCK, minlength=-(-n // INDEX_BLOCK))
    assert record[COUNT_KEY].numpy().tolist() == blocks.tolist() and (n < INDEX_BLOCK or (blocks > 0).sum() > 1)
    back = decode(record, "topk16", n, wire)
    assert np.array_equal(np.flatnonzero(back), index) and len(index) == k
    s = np.abs(x[index]).max()
    assert record[SCALE_KEY].numpy().tolist() == [s]
    v = x[index]
    # v / s rounded to float32, to half (2^-11 relative in its normal range, 2^-25 absolute below), then · s in float32
    bound = (1 + EPS) * np.maximum(2.0**-11 * np.abs(v), 2.0**-25 * s) + 3 * EPS * np.abs(v)
    assert (np.abs(back[index] - v) <= bound).all()
    assert not np.array_equal(back[index], v)  # it does round
    assert np.array_equal(np.delete(residual, index), np.delete(x, index))
    assert np.array_equal(residual[index], v - back[index])  # the device computes what the server decodes, bit for bit


@pytest.mark.parametrize("codec", ["topk", "topk16"])
def test_error_feedback_delivers_everything_over_messages(codec):
    """Σ_t decoded_t + e_T = Σ_t x_t up to float32's rounding of p_t = x_t + e_{t−1} and, for topk16, of
    e_t = p_t − decoded_t: nothing a device computed is lost, only delayed (Stich et al. 2018, Algorithm 1)."""
    wire, residual = WireCodecs(topk_fraction=0.02), None
    sent, total, bound = np.zeros(N, np.float64), np.zeros(N, np.float64), np.zeros(N, np.float64)
    for t in range(30):
        x = vector(10 + t)
        p = x if residual is None else x + residual
        record, residual = encode(x, codec, wire, residual)
        sent += decode(record, codec, N, wire)
        total += x
        bound += np.abs(p) * EPS * (1 if codec == "topk" else 2)
    assert (np.abs(sent + residual - total) <= bound + 1e-45).all()
    assert np.abs(residual).sum() > 0 and np.abs(sent).sum() > 0.5 * np.abs(total).sum()


def test_bytes_on_the_wire_are_the_codecs_fraction():
    n = 200_000
    x, wire = vector(3, n), WireCodecs()
    plain = wire_bytes(encode(x, "none", wire)[0])
    assert 4 * n <= plain <= 4 * n + 512
    records = {c: encode(x, c, wire)[0] for c in UPDATE_CODECS}
    for c, record in records.items():  # what the runtime counts, and a simulated link carries
        assert sum(record[k].numpy().nbytes for k in record) == encoded_nbytes(c, n, wire), c
    ratio = {c: wire_bytes(record) / plain for c, record in records.items()}
    assert ratio["fp16"] == pytest.approx(0.5, abs=0.002)
    assert ratio["int8"] == pytest.approx(0.25 + 1 / 256, abs=0.002)  # a float32 scale per 256 values
    assert ratio["topk"] == pytest.approx(2 * 0.01, abs=0.002)  # an int32 index and a float32 value per entry
    # a uint16 index and a float16 value per entry, in four arrays (Flower frames each in ~450 bytes)
    assert ratio["topk16"] == pytest.approx(0.01, abs=0.003) and ratio["topk16"] < 0.62 * ratio["topk"]


def _rec(**arrays: np.ndarray) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


N8 = 300
Q = np.zeros(N8, np.int8)
S = np.ones(-(-N8 // 256), np.float32)
K = topk_count(N8, 0.01)
H = np.ones(K, np.float16)


def _t16(index=(1, 5, 9), values=H, counts=(K,), scale=(1.0,)) -> ArrayRecord:
    return _rec(params=values, **{INDEX_KEY: np.array(index, np.uint16), COUNT_KEY: np.array(counts, np.uint32),
                                  SCALE_KEY: np.array(scale, np.float32)})


@pytest.mark.parametrize(("codec", "record", "says"), [
    ("none", _rec(params=np.zeros(N8, np.int32)), "expected a float dtype"),
    ("none", _rec(params=np.full(N8, np.inf, np.float32)), "non-finite"),
    ("fp16", _rec(params=np.zeros(N8, np.float32)), "expected float16"),
    ("fp16", _rec(params=np.full(N8, np.inf, np.float16)), "non-finite"),
    ("fp16", _rec(params=np.zeros(N8 + 1, np.float16)), "has shape"),
    ("int8", _rec(params=Q), "expected the arrays"),
    ("int8", _rec(params=Q.astype(np.int16), **{SCALE_KEY: S}), "expected int8"),
    ("int8", _rec(params=np.full(N8, -128, np.int8), **{SCALE_KEY: S}), "-128"),
    ("int8", _rec(params=Q, **{SCALE_KEY: -S}), "negative scales"),
    ("int8", _rec(params=Q, **{SCALE_KEY: np.full_like(S, np.nan)}), "non-finite"),
    ("int8", _rec(params=np.full(N8, 127, np.int8), **{SCALE_KEY: np.full_like(S, 3e38)}), "non-finite"),
    ("int8", _rec(params=Q, **{SCALE_KEY: S[:-1]}), "has shape"),
    ("topk", _rec(params=np.ones(K, np.float32), **{INDEX_KEY: np.array([5, 5, 7], np.int32)}), "increasing"),
    ("topk", _rec(params=np.ones(K, np.float32), **{INDEX_KEY: np.array([7, 5, 9], np.int32)}), "increasing"),
    ("topk", _rec(params=np.ones(K, np.float32), **{INDEX_KEY: np.array([-1, 5, 9], np.int32)}), "increasing"),
    ("topk", _rec(params=np.ones(K, np.float32), **{INDEX_KEY: np.array([1, 5, N8], np.int32)}), "increasing"),
    ("topk", _rec(params=np.ones(K + 1, np.float32), **{INDEX_KEY: np.arange(K + 1, dtype=np.int32)}), "shape"),
    ("topk", _rec(params=np.ones(K, np.float32), **{INDEX_KEY: np.arange(K, dtype=np.int64)}), "expected int32"),
    ("topk", _rec(params=np.full(K, np.nan, np.float32), **{INDEX_KEY: np.arange(K, dtype=np.int32)}), "non-finite"),
    ("topk16", _t16(index=(5, 5, 7)), "increasing"),
    ("topk16", _t16(index=(1, 5, N8)), "increasing"),
    ("topk16", _t16(counts=(K + 1,)), "counts 4 entries, expected 3"),
    ("topk16", _t16(counts=(K, 0)), "has shape"),
    ("topk16", _rec(params=H, **{INDEX_KEY: np.array([1, 5, 9], np.int32), COUNT_KEY: np.array([K], np.uint32),
                                  SCALE_KEY: np.ones(1, np.float32)}), "expected uint16"),
    ("topk16", _t16(values=np.ones(K, np.float32)), "expected float16"),
    ("topk16", _t16(values=np.full(K, np.inf, np.float16)), "non-finite"),
    ("topk16", _t16(scale=(-1.0,)), "negative"),
    ("topk16", _t16(scale=(np.nan,)), "non-finite"),
    ("topk16", _t16(values=np.full(K, HALF_MAX, np.float16), scale=(3e38,)), "non-finite"),
    ("topk16", _rec(params=H, **{INDEX_KEY: np.array([1, 5, 9], np.uint16)}), "expected the arrays"),
])
def test_a_record_the_codec_never_makes_is_refused_naming_why(codec, record, says):
    assert K == 3
    with pytest.raises(BadArrays, match=says):
        decode(record, codec, N8, WireCodecs())


def test_what_a_codec_cannot_carry_is_refused_at_encoding():
    with pytest.raises(ValueError, match="up to 65504"):
        encode(np.array([1.0, 2 * HALF_MAX], np.float32), "fp16", WireCodecs())
    with pytest.raises(ValueError, match="non-finite"):
        encode(np.array([1.0, np.nan], np.float32), "int8", WireCodecs())


# -- the device's mod ---------------------------------------------------------------------------------------------

def _train_message(codecs: WireCodecs, model: ArrayRecord, updates_before: int = 0, run_id: int = 7,
                   message_type: str = MessageType.TRAIN, **keys: str) -> Message:
    config = ConfigRecord({**options_dict(codecs), UPDATES_BEFORE: updates_before, **keys})
    content = RecordDict({ARRAYS: model, CONFIG: config})
    return make_message(metadata=Metadata(run_id=run_id, message_id="", src_node_id=0, dst_node_id=1,
                                          reply_to_message_id="", group_id="", ttl=3600.0,
                                          message_type=message_type, created_at=time.time()), content=content)


def _handler(update: np.ndarray, seen: list[np.ndarray]):
    def handle(msg: Message, _context: Context) -> Message:
        seen.append(msg.content[ARRAYS][WIRE_KEY].numpy().copy())
        return Message(RecordDict({ARRAYS: ArrayRecord({WIRE_KEY: Array(update)}),
                                   METRICS: MetricRecord({PARTITION_ID: 3})}), reply_to=msg)
    return handle


def _context(node_config: dict) -> Context:
    return Context(run_id=7, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def test_the_mod_decodes_the_model_and_encodes_the_update_as_the_message_says():
    codecs = WireCodecs(update_codec="int8", model_codec="fp16")
    model, update, seen = vector(4, 500), vector(5, 500), []
    msg = _train_message(codecs, encode(model, "fp16", codecs)[0])
    reply = codec_mod(msg, _context({"cache-dir": ""}), _handler(update, seen))
    assert seen[0].dtype == np.float32 and np.array_equal(seen[0], model.astype(np.float16).astype(np.float32))
    assert sorted(reply.content[ARRAYS].keys()) == sorted([WIRE_KEY, SCALE_KEY])
    np.testing.assert_array_equal(decode(reply.content[ARRAYS], "int8", 500, codecs),
                                  decode(encode(update, "int8", codecs)[0], "int8", 500, codecs))
    plain = codec_mod(_train_message(WireCodecs(), ArrayRecord({WIRE_KEY: Array(model)})),
                      _context({"cache-dir": ""}), _handler(update, seen))
    assert np.array_equal(plain.content[ARRAYS][WIRE_KEY].numpy(), update)  # none: untouched


@pytest.mark.parametrize("codec", ["topk", "topk16"])
def test_topks_residual_survives_the_devices_restart_through_its_file(tmp_path, caplog, codec):
    codecs = WireCodecs(update_codec=codec, topk_fraction=0.05)
    model = ArrayRecord({WIRE_KEY: Array(np.zeros(400, np.float32))})
    first, second = vector(6, 400), vector(7, 400)
    context = _context({"cache-dir": str(tmp_path)})
    codec_mod(_train_message(codecs, model), context, _handler(first, []))
    kept = context.state[RESIDUAL][WIRE_KEY].numpy().copy()
    assert (tmp_path / "run-7" / "residual-3.npy").is_file()
    assert np.array_equal(np.load(tmp_path / "run-7" / "residual-3.npy"), kept)
    # the device's process restarted: Flower's Context.state is new and empty, the node's file is there
    restarted = _context({"cache-dir": str(tmp_path)})
    reply = codec_mod(_train_message(codecs, model, updates_before=1), restarted, _handler(second, []))
    assert reply.content[METRICS][LOST] == 0
    expected, _ = encode(second, codec, codecs, kept)
    assert np.array_equal(decode(reply.content[ARRAYS], codec, 400, codecs), decode(expected, codec, 400, codecs))
    # a device with no state and no file, whose earlier updates were dispatched, says its residual is lost
    with caplog.at_level(logging.WARNING):
        lost = codec_mod(_train_message(codecs, model, updates_before=2), _context({"cache-dir": ""}),
                         _handler(second, []))
    assert lost.content[METRICS][LOST] == 1 and "residual for run 7 is lost" in caplog.text
    fresh = codec_mod(_train_message(codecs, model, updates_before=0), _context({"cache-dir": ""}),
                      _handler(second, []))
    assert fresh.content[METRICS][LOST] == 0  # its first update: nothing to lose


# -- model-difference ---------------------------------------------------------------------------------------------

def _walk(steps: int, n: int = N, seed: int = 8) -> list[np.ndarray]:
    """Models of a run: each the last plus a step a hundredth of its size."""
    rng = np.random.default_rng(seed)
    models = [vector(seed, n)]
    for _ in range(steps - 1):
        models.append((models[-1] + 0.01 * np.abs(models[-1]) * rng.standard_normal(n)).astype(np.float32))
    return models


def test_a_model_difference_leaves_the_device_within_the_last_differences_step_with_no_drift(tmp_path):
    """The device's copy, through the mod, has the bits of the server's; each model is within half an int8 step of
    its difference's blocks (plus float32's rounding of one subtraction, one product and one addition), not of the
    model's: the error does not add up over messages."""
    codecs = WireCodecs(model_codec="int8", model_difference=True)
    context, held, seen = _context({"cache-dir": str(tmp_path), "partition-id": 3}), None, []
    for w in _walk(6):
        record = encode_model(w, codecs, held)
        base = "" if held is None else model_digest(held)
        expected = apply_difference(held, record, codecs)
        codec_mod(_train_message(codecs, record, **{MODEL_BASE: base}), context, _handler(np.zeros(N, np.float32),
                                                                                          seen))
        assert np.array_equal(seen[-1], expected) and model_digest(seen[-1]) == model_digest(expected)
        if held is not None:
            d = w - held
            step = np.repeat(np.abs(np.pad(d, (0, -N % 256)).reshape(-1, 256)).max(axis=1) / 127, 256)[:N]
            bound = step / 2 + 3 * EPS * np.abs(d) + 2 * EPS * np.abs(w) + 1e-45
            assert (np.abs(expected - w) <= bound).all()
            assert np.abs(expected - w).max() < 0.05 * np.abs(decode(encode(w, "int8", codecs)[0], "int8", N, codecs)
                                                               - w).max()  # far below int8 of the model itself
        held = expected
    assert np.array_equal(np.load(tmp_path / "run-7" / "model-3.npy"), held)


def test_a_topk_difference_sends_what_earlier_messages_left_out():
    """The server's copy is error feedback: with the model fixed, ⌈1/f⌉ messages bring every entry, to float32's
    rounding of one subtraction and one addition."""
    codecs = WireCodecs(model_codec="topk", model_difference=True, topk_fraction=0.1)
    w = vector(9, 1000)
    held = apply_difference(None, encode_model(w, codecs), codecs)  # the whole model, as int8
    assert encode_model(w, codecs).keys() == encode(w, "int8", codecs)[0].keys()
    start = held.copy()
    for _ in range(10):
        held = apply_difference(held, encode_model(w, codecs, held), codecs)
    assert (np.abs(held - w) <= 2 * EPS * (np.abs(w) + np.abs(w - start)) + 1e-45).all()
    assert not (np.abs(start - w) <= 2 * EPS * np.abs(w) + 1e-45).all()  # int8 alone was not that close


def test_a_device_that_lost_the_model_a_difference_applies_to_says_so_and_evaluation_leaves_it_alone(tmp_path):
    codecs = WireCodecs(model_codec="int8", model_difference=True)
    w0, w1 = _walk(2, 500)
    context, seen = _context({"cache-dir": str(tmp_path), "partition-id": 3}), []
    codec_mod(_train_message(codecs, encode_model(w0, codecs), **{MODEL_BASE: ""}), context,
              _handler(np.zeros(500, np.float32), seen))
    held = seen[-1].copy()
    # an evaluate message carries the whole model and no base: the device's copy stays
    codec_mod(_train_message(codecs, encode_model(w1, codecs), message_type=MessageType.EVALUATE), context,
              _handler(np.zeros(500, np.float32), seen))
    assert np.array_equal(context.state[HELD][WIRE_KEY].numpy(), held)
    # the device's process restarted: its file holds the model
    restarted = _context({"cache-dir": str(tmp_path), "partition-id": 3})
    record = encode_model(w1, codecs, held)
    codec_mod(_train_message(codecs, record, **{MODEL_BASE: model_digest(held)}), restarted,
              _handler(np.zeros(500, np.float32), seen))
    assert np.array_equal(seen[-1], apply_difference(held, record, codecs))
    # a device without it (no state, no file) or with another model answers with an error naming both
    for node_config in ({"cache-dir": ""}, {"cache-dir": str(tmp_path), "partition-id": 3}):
        reply = codec_mod(_train_message(codecs, record, **{MODEL_BASE: model_digest(held)}), _context(node_config),
                          _handler(np.zeros(500, np.float32), seen))
        assert reply.has_error() and f"no longer holds the model {model_digest(held)}" in reply.error.reason


def test_the_server_keeps_a_devices_copy_only_when_its_reply_says_the_message_arrived(monkeypatch):
    """A reply that is not an error confirms the copy; an error or none leaves it unknown, and the next message
    carries the whole model (fewer bytes only for a difference)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 7), ("_node_id", 0)):  # a ServerApp's task, run, node
        monkeypatch.setattr(TaskIdentity, name, value)
    codecs = {"model-codec": "topk", "model-difference": True, "topk-fraction": 0.01}
    spec = ParamSpec(("w",), ((N,),))
    dispatcher = Dispatcher(spec, codecs, seed=0)
    w0, w1 = (torch.from_numpy(w) for w in _walk(2))
    whole, sparse = encoded_nbytes("int8", N, WireCodecs()), encoded_nbytes("topk", N, WireCodecs(topk_fraction=0.01))
    assert dispatcher.model_nbytes(5, N) == whole
    first = dispatcher.message(1, Payload(w0), 0, client=5)
    assert first.content[CONFIG][MODEL_BASE] == "" and INDEX_KEY not in first.content[ARRAYS]
    dispatcher.settle(5, Message(RecordDict(), reply_to=first))
    assert dispatcher.model_nbytes(5, N) == sparse and dispatcher.model_nbytes(6, N) == whole
    second = dispatcher.message(1, Payload(w1), 1, client=5)
    assert second.content[CONFIG][MODEL_BASE] == model_digest(dispatcher.held[5])
    assert INDEX_KEY in second.content[ARRAYS]
    dispatcher.settle(5, Message(Error(code=0, reason="the device lost it"), reply_to=second))
    assert 5 not in dispatcher.held and dispatcher.model_nbytes(5, N) == whole
    third = dispatcher.message(1, Payload(w1), 1, client=5)
    assert third.content[CONFIG][MODEL_BASE] == ""
    dispatcher.settle(5, Message(RecordDict(), reply_to=third))
    dispatcher.message(1, Payload(w0), 2, client=5)
    dispatcher.settle(5, None)  # timed out: did it arrive?
    assert 5 not in dispatcher.held and dispatcher.model_nbytes(5, N) == whole
    evaluate = dispatcher.message(1, Payload(w1), 1, MessageType.EVALUATE)
    assert MODEL_BASE not in evaluate.content[CONFIG]
    # within its memory (model-copies-mib): the copy kept longest ago goes first
    dispatcher.held_limit = 2
    for client in (5, 6, 5, 7):
        dispatcher.settle(client, Message(RecordDict(), reply_to=dispatcher.message(1, Payload(w1), 1, client=client)))
    assert list(dispatcher.held) == [5, 7]


def test_a_memory_for_copies_below_one_model_is_refused_at_start(tmp_path, capsys):
    keys = ["model-codec=int8", "model-difference=true", f"output-dir={tmp_path}", "num-rounds=2"]
    assert main(["run", "fedbuff-digits", *keys, "model-copies-mib=0.1"]) == 2
    assert "'model-copies-mib' = 0.1" in capsys.readouterr().err and not any(tmp_path.iterdir())


# -- the run's keys -----------------------------------------------------------------------------------------------

def test_codecs_are_run_keys_checked_at_start_and_a_pairing_a_method_cannot_use_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="'update-codec' = 'gzip'"):
        make_config({"update-codec": "gzip"})
    with pytest.raises(ConfigError, match="'model-codec' = 'topk'.*model-difference = true"):
        make_config({"model-codec": "topk"})
    with pytest.raises(ConfigError, match="'model-difference' = True.*as many bytes as the model"):
        make_config({"model-difference": True})
    with pytest.raises(ConfigError, match="'topk-fraction' = 0"):
        make_config({"topk-fraction": 0.0})
    with pytest.raises(ConfigError, match="'model-codec' = 'topk16'.*model-difference = true"):
        make_config({"model-codec": "topk16"})
    for sparse in ("topk", "topk16"):
        with pytest.raises(ConfigError, match=rf"'update-codec' = '{sparse}'.*barycenter.*strategy feddual"):
            make_config({"strategy": "feddual", "update-codec": sparse})
    for fine in ({"strategy": "feddual", "update-codec": "int8"},
                 {"strategy": "feddual", "update-codec": "topk", "dynamic-source": "loss-gradient"},
                 {"strategy": "fedbuff", "update-codec": "topk", "model-codec": "int8"},
                 {"strategy": "fedbuff", "update-codec": "topk", "model-codec": "topk", "model-difference": True},
                 {"strategy": "fedbuff", "update-codec": "topk16", "model-codec": "topk16", "model-difference": True}):
        cfg = make_config(fine)
        assert cfg.update_codec == fine["update-codec"]
    # as a user runs it: exit 2 before anything runs, the reason on stderr, no run folder
    assert main(["run", "feddual-digits", "update-codec=topk", f"output-dir={tmp_path}"]) == 2
    assert "'update-codec' = 'topk'" in capsys.readouterr().err and not any(tmp_path.iterdir())

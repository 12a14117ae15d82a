"""The wire's codecs: a model on its way to a device and a device's update on its way back, in fewer bytes.

Every codec turns the flat float32 vector x ∈ ℝⁿ that the wire carries (common/params.py's one array) into an
``ArrayRecord`` and back, on CPU with numpy alone (a device's ClientApp loads no torch for a message that does no
local work; the codecs come with it). What each costs and keeps (docs/methods.md, "The
wire's codecs"):

- ``none``: x as float32, 4n bytes.
- ``fp16``: x rounded to IEEE half precision, 2n bytes. |x̂ᵢ − xᵢ| ≤ 2⁻¹¹|xᵢ| where |xᵢ| ≥ 2⁻¹⁴ (half's normal
  range) and ≤ 2⁻²⁵ below it; an x with a value past half's largest (65504) is refused at encoding, not sent as ∞.
- ``int8``: block-wise absmax quantization (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
  Quantization", §2): x cut into blocks b of B values, sᵦ = max_{i∈b}|xᵢ| / 127, qᵢ = round(xᵢ / sᵦ) ∈ [−127, 127],
  x̂ᵢ = qᵢ sᵦ; |x̂ᵢ − xᵢ| ≤ sᵦ / 2 (and float32's rounding of one division and one product), n + 4⌈n/B⌉ bytes.
- ``topk``: the k = ⌈f n⌉ largest entries by magnitude with error feedback (Stich, Cordonnier and Jaggi 2018,
  "Sparsified SGD with Memory", Algorithm 1): the device keeps the residual e of what it did not send, sends
  p = x + e's top k as (index, value) pairs and keeps e ← p − top_k(p); 8k bytes (a ratio of 1/(2f) against none).
  Biased per message, unbiased over messages: nothing a device computed is dropped, only delayed.
- ``topk16``: topk's entries and error feedback in half its bytes. An index is 16 bits inside its block of 2¹⁶
  entries (a uint32 count per block says how many of the k fall in each); a value v travels as v / s in half
  precision, s = the largest kept magnitude (one float32), so that no value overflows half and the largest use its
  normal range: |v̂ − v| ≤ 2⁻¹¹|v| where |v| ≥ 2⁻¹⁴s, ≤ 2⁻²⁵s below it (and float32's product). That rounding joins
  the residual with what was not sent (e ← p − decoded), so it too is only delayed. 4k + 4⌈n/2¹⁶⌉ + 4 bytes, a
  ratio of about 1/f: at the same bytes, twice topk's entries.

With ``model-difference``, a model travels as the difference d = w − ŵ between the server's model w and the
model ŵ the device holds, encoded by ``model-codec`` (topk included: the largest entries of d), and the device
holds ŵ + d̂ next. The server keeps each device's ŵ, computed by :func:`apply_difference` as the device computes it
(the same float32 operations: the same bits, checked by :func:`model_digest`), so what a message does not carry
stays in the next difference: error feedback on the server's side (Tang et al. 2019, "DoubleSqueeze: Parallel
Stochastic Gradient Descent with Double-pass Error-Compensated Compression", Alg. 1's server half, per device).

Decoding checks everything a hostile device could put in a record (keys, dtypes, shapes, ranges, finiteness):
:class:`BadArrays` names what does not fit, and the runtime rejects and counts the reply.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from common.config import COUNT, OneOf, Range, option

WIRE_KEY = "params"  # the wire's one array (common/params.py)


class BadArrays(ValueError):
    """Arrays that do not fit the model (wrong names, shapes, dtype) or are not finite."""


SCALE_KEY, INDEX_KEY, COUNT_KEY = f"{WIRE_KEY}-scale", f"{WIRE_KEY}-index", f"{WIRE_KEY}-count"
HALF_MAX = float(np.finfo(np.float16).max)
INT8_LEVELS = 127  # symmetric: −128 is never produced, and refused

UPDATE_CODECS = ("none", "fp16", "int8", "topk", "topk16")
MODEL_CODECS = UPDATE_CODECS  # topk only as a difference: a model's top-k entries alone are not a model
SPARSE = ("topk", "topk16")  # the top-k codecs: error feedback on the device, a model only as a difference
INDEX_BLOCK = 1 << 16  # topk16's 16-bit index counts inside its block of this many entries


@dataclass(frozen=True)
class WireCodecs:
    """The wire keys: how models travel to devices and updates back. They travel in every message's config, so a
    device encodes and decodes as its run says."""

    update_codec: str = option("none", OneOf(UPDATE_CODECS), "how a device's update travels to the server: "
                               "none (float32), fp16, int8 (block-wise absmax), topk (the largest entries, with "
                               "error feedback on the device), topk16 (topk in half the bytes: 16-bit indices "
                               "and values)")
    model_codec: str = option("none", OneOf(MODEL_CODECS), "how the model travels to devices: none (float32), "
                              "fp16, int8 (block-wise absmax), topk or topk16 (with `model-difference` only); the "
                              "server keeps its own in float32")
    model_difference: bool = option(False, None, "send a device the difference between the model and the one it "
                                    "holds, encoded as `model-codec` says (the server keeps each device's copy: "
                                    "num-clients models in memory)")
    int8_block: int = option(256, COUNT, "B, values per block of int8's scales (4 bytes of scale per block)")
    topk_fraction: float = option(0.01, Range(0, 1, low_open=True), "f, the share of entries topk and topk16 "
                                  "send, of an update or a model's difference (⌈f n⌉ of n)")


PLAIN = WireCodecs()  # float32 both ways


def wire_refusal(codecs: WireCodecs) -> tuple[str, str] | None:
    """(the key to change, what it allows) when the wire keys do not fit together; None when they do."""
    if codecs.model_codec in SPARSE and not codecs.model_difference:
        return "model-codec", ("none, fp16 or int8, or topk or topk16 with model-difference = true (a model's largest "
                               "entries alone are not a model; of a difference they are)")
    if codecs.model_difference and codecs.model_codec == "none":
        return "model-difference", ("false with model-codec = 'none' (a float32 difference is as many bytes as the "
                                    "model): set model-codec")
    return None


def full_codec(codecs: WireCodecs) -> str:
    """How a whole model travels (to a device that holds none, and in evaluate messages): as ``model-codec``
    says, int8 where that is a top-k codec."""
    return "int8" if codecs.model_codec in SPARSE else codecs.model_codec


def model_digest(x: np.ndarray) -> str:
    """A short digest of a float32 model's bits: the name of the copy a difference applies to."""
    return hashlib.blake2b(np.ascontiguousarray(x, dtype=np.float32).tobytes(), digest_size=8).hexdigest()


def apply_difference(held: np.ndarray | None, record: ArrayRecord, codecs: WireCodecs) -> np.ndarray:
    """The model a device holds after `record`: ``held`` + the decoded difference, or (held None) the whole model
    `record` carries. The device and the server both compute it with this, so their copies have the same bits."""
    if held is None:
        numel = int(np.prod(record[WIRE_KEY].shape)) if WIRE_KEY in record else 0
        return decode(record, full_codec(codecs), numel, codecs)
    return held + decode(record, codecs.model_codec, held.size, codecs)


def encode_model(x: np.ndarray, codecs: WireCodecs, held: np.ndarray | None = None) -> ArrayRecord:
    """The record of model `x` for a device holding `held` (None: none, or no ``model-difference``): the
    difference x − held as ``model-codec`` says, or the whole model as :func:`full_codec` says."""
    if held is None:
        return encode(x, full_codec(codecs), codecs)[0]
    return encode(np.asarray(x, dtype=np.float32) - held, codecs.model_codec, codecs)[0]


def _array(values: np.ndarray) -> Array:
    return Array(np.ascontiguousarray(values))


def _expect(record: ArrayRecord, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    if sorted(record.keys()) != sorted(keys):
        what = "one array" if len(keys) == 1 else "the arrays"
        raise BadArrays(f"expected {what} {', '.join(map(repr, keys))}, got {sorted(record.keys())[:4]}")
    return {k: record[k].numpy() for k in keys}


def _check(name: str, arr: np.ndarray, dtype: type, shape: tuple[int, ...]) -> None:
    if arr.dtype != dtype:
        raise BadArrays(f"'{name}' has dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if tuple(arr.shape) != shape:
        raise BadArrays(f"'{name}' has shape {tuple(arr.shape)}, expected {shape}")


def finite_float32(name: str, arr: np.ndarray) -> np.ndarray:
    """A float32 copy of `arr` (a record's buffer is read-only), or :class:`BadArrays` if it is not finite floats."""
    if not np.issubdtype(arr.dtype, np.floating):
        raise BadArrays(f"'{name}' has dtype {arr.dtype}, expected a float dtype")
    return _finite(name, np.array(arr, dtype=np.float32))


def _finite(name: str, values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        raise BadArrays(f"'{name}' has {int((~np.isfinite(values)).sum())} non-finite values")
    return values


def topk_count(numel: int, fraction: float) -> int:
    """k = ⌈f n⌉ (at least 1): how many entries of an n-vector topk sends."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def encode(x: np.ndarray, codec: str, wire: WireCodecs, residual: np.ndarray | None = None
           ) -> tuple[ArrayRecord, np.ndarray | None]:
    """`x` (flat, float32) as `codec`'s record, and topk's new residual (None for the others). `residual`: topk's e
    from the device's last update (None: zero). Raises ValueError for an x that `codec` cannot carry (not finite;
    fp16: past half's range)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if not np.isfinite(x).all():
        raise ValueError(f"an array with {int((~np.isfinite(x)).sum())} non-finite values cannot be encoded")
    if codec == "none":
        return ArrayRecord({WIRE_KEY: _array(x)}), None
    if codec == "fp16":
        if x.size and (big := float(np.abs(x).max())) > HALF_MAX:
            raise ValueError(f"fp16 carries values up to {HALF_MAX:g}; this array holds {big:g}")
        return ArrayRecord({WIRE_KEY: _array(x.astype(np.float16))}), None
    if codec == "int8":
        blocks = np.pad(x, (0, -x.size % wire.int8_block)).reshape(-1, wire.int8_block)
        scale = (np.abs(blocks).max(axis=1) / np.float32(INT8_LEVELS)).astype(np.float32)
        q = np.clip(np.rint(blocks / np.where(scale > 0, scale, np.float32(1))[:, None]), -INT8_LEVELS, INT8_LEVELS)
        return ArrayRecord({WIRE_KEY: _array(q.reshape(-1)[: x.size].astype(np.int8)),
                            SCALE_KEY: _array(scale)}), None
    if codec in SPARSE:
        p = x if residual is None else x + np.asarray(residual, dtype=np.float32)
        k = topk_count(p.size, wire.topk_fraction)
        index = np.sort(np.argpartition(-np.abs(p), k - 1)[:k])
        if codec == "topk":
            sent = p[index]
            record = {WIRE_KEY: sent, INDEX_KEY: index.astype(np.int32)}
        else:
            scale = np.float32(np.abs(p[index]).max()) or np.float32(1)
            half = (p[index] / scale).astype(np.float16)
            sent = half.astype(np.float32) * scale  # as decode computes it: the residual is what the server lacks
            record = {WIRE_KEY: half, INDEX_KEY: (index % INDEX_BLOCK).astype(np.uint16),
                      COUNT_KEY: np.bincount(index // INDEX_BLOCK, minlength=-(-p.size // INDEX_BLOCK)).astype(
                          np.uint32), SCALE_KEY: np.array([scale], np.float32)}
        kept = p.copy()
        kept[index] -= sent
        return ArrayRecord({key: _array(v) for key, v in record.items()}), kept
    raise ValueError(f"unknown codec {codec!r}; known: {', '.join(UPDATE_CODECS)}")


def decode(record: ArrayRecord, codec: str, n: int, wire: WireCodecs) -> np.ndarray:
    """The flat float32 vector of `n` values in `record` as `codec` encoded it, or :class:`BadArrays` naming what
    does not fit (any key, dtype, shape or value the codec never makes; ``none`` takes any float dtype)."""
    if codec == "none":
        arr = _expect(record, (WIRE_KEY,))[WIRE_KEY]
        if np.issubdtype(arr.dtype, np.floating):
            _check(WIRE_KEY, arr, arr.dtype.type, (n,))
        return finite_float32(WIRE_KEY, arr)
    if codec == "fp16":
        arr = _expect(record, (WIRE_KEY,))[WIRE_KEY]
        _check(WIRE_KEY, arr, np.float16, (n,))
        return _finite(WIRE_KEY, arr.astype(np.float32))
    if codec == "int8":
        got = _expect(record, (WIRE_KEY, SCALE_KEY))
        _check(WIRE_KEY, got[WIRE_KEY], np.int8, (n,))
        _check(SCALE_KEY, got[SCALE_KEY], np.float32, (-(-n // wire.int8_block),))
        q = got[WIRE_KEY]
        if n and q.min() < -INT8_LEVELS:
            raise BadArrays(f"'{WIRE_KEY}' holds -128, which int8 never sends")
        scale = _finite(SCALE_KEY, got[SCALE_KEY])
        if (scale < 0).any():
            raise BadArrays(f"'{SCALE_KEY}' holds negative scales")
        with np.errstate(over="ignore"):  # a product past float32's range is refused just below
            out = q.astype(np.float32) * np.repeat(scale, wire.int8_block)[:n]
        return _finite(WIRE_KEY, out)
    if codec == "topk":
        k = topk_count(n, wire.topk_fraction)
        got = _expect(record, (WIRE_KEY, INDEX_KEY))
        _check(WIRE_KEY, got[WIRE_KEY], np.float32, (k,))
        _check(INDEX_KEY, got[INDEX_KEY], np.int32, (k,))
        out = np.zeros(n, dtype=np.float32)
        out[_increasing(got[INDEX_KEY].astype(np.int64), n)] = _finite(WIRE_KEY, got[WIRE_KEY])
        return out
    if codec == "topk16":
        k, blocks = topk_count(n, wire.topk_fraction), -(-n // INDEX_BLOCK)
        got = _expect(record, (WIRE_KEY, INDEX_KEY, COUNT_KEY, SCALE_KEY))
        _check(WIRE_KEY, got[WIRE_KEY], np.float16, (k,))
        _check(INDEX_KEY, got[INDEX_KEY], np.uint16, (k,))
        _check(COUNT_KEY, got[COUNT_KEY], np.uint32, (blocks,))
        _check(SCALE_KEY, got[SCALE_KEY], np.float32, (1,))
        counts = got[COUNT_KEY].astype(np.int64)
        if counts.sum() != k:
            raise BadArrays(f"'{COUNT_KEY}' counts {counts.sum()} entries, expected {k}")
        index = np.repeat(np.arange(blocks, dtype=np.int64) * INDEX_BLOCK, counts) + got[INDEX_KEY]
        scale = _finite(SCALE_KEY, got[SCALE_KEY])[0]
        if scale < 0:
            raise BadArrays(f"'{SCALE_KEY}' is negative")
        with np.errstate(over="ignore"):  # a product past float32's range is refused just below
            values = _finite(WIRE_KEY, got[WIRE_KEY].astype(np.float32)) * scale
        out = np.zeros(n, dtype=np.float32)
        out[_increasing(index, n)] = _finite(WIRE_KEY, values)
        return out
    raise BadArrays(f"unknown codec {codec!r}")


def _increasing(index: np.ndarray, n: int) -> np.ndarray:
    """`index` if it is strictly increasing in [0, n) (each entry once), else :class:`BadArrays`."""
    if index[0] < 0 or index[-1] >= n or (len(index) > 1 and not (np.diff(index) > 0).all()):
        raise BadArrays(f"'{INDEX_KEY}' is not {len(index)} increasing indices in [0, {n})")
    return index


def encoded_nbytes(codec: str, n: int, wire: WireCodecs) -> int:
    """The bytes of the values `codec` sends for an n-vector (its arrays' data, their framing aside): what a
    simulated link carries, and the runtime counts."""
    return {"none": 4 * n, "fp16": 2 * n, "int8": n + 4 * -(-n // wire.int8_block),
            "topk": 8 * topk_count(n, wire.topk_fraction),
            "topk16": 4 * topk_count(n, wire.topk_fraction) + 4 * -(-n // INDEX_BLOCK) + 4}[codec]

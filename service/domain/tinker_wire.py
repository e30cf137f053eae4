"""The protobuf messages of the Tinker API that are not JSON: ``forward_backward``'s request body and the
``ForwardBackwardOutput`` and ``SampleResponse`` a future resolves to when the client asks for
``application/x-protobuf`` (the official SDK always does for those two). Field numbers are those of the
SDK's ``tinker_public.proto`` (tinker 0.38); the wire format is protobuf's own (varints, length-delimited
fields, little-endian fixed widths), read and written here in plain Python so that the API needs neither
protobuf nor numpy. Only what memfit uses is decoded; an image or audio chunk is reported, not ignored.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass, field

# DType enum of tinker_public.proto
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_ARRAY_CODE = {DTYPE_FLOAT32: "f", DTYPE_INT64: "q", DTYPE_INT32: "i"}
_DTYPE_NAME = {DTYPE_FLOAT32: "float32", DTYPE_INT64: "int64", DTYPE_INT32: "int64"}
STOP_REASON = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A body that is not the message it should be; ``param`` names the field."""

    def __init__(self, message: str, param: str = "body"):
        super().__init__(message)
        self.param = param


# --- reading ------------------------------------------------------------------------------------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 64 bits")


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs: an int for varints and fixed widths (raw bits), bytes for length-delimited."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            if i + 8 > len(buf):
                raise WireError("truncated fixed64")
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise WireError("truncated length-delimited field")
            value, i = bytes(buf[i:i + n]), i + n
        elif wire == 5:
            if i + 4 > len(buf):
                raise WireError("truncated fixed32")
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        out.append((number, value))
    return out


def _array(code: str, data: bytes, param: str) -> list:
    a = array(code)
    if len(data) % a.itemsize:
        raise WireError(f"{len(data)} bytes is not a whole number of {a.itemsize}-byte values", param)
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass
class Tensor:
    dtype: str
    shape: list[int]
    data: list  # flat, row-major


def _tensor(buf: bytes, param: str) -> Tensor:
    dense, dtype, shape, sparse = None, 0, [], False
    for n, v in fields(buf):
        if n == 1:
            dense = v
        elif n == 2:
            sparse = True
        elif n == 3:
            dtype = v
        elif n == 4:
            if isinstance(v, bytes):  # packed
                i = 0
                while i < len(v):
                    x, i = _varint(v, i)
                    shape.append(_signed(x))
            else:
                shape.append(_signed(v))
    if sparse:
        raise WireError("sparse (CSR) tensors are not supported; send dense tensors", param)
    if dtype not in _ARRAY_CODE:
        raise WireError(f"tensor dtype {dtype} is not supported (float32 or int64)", param)
    return Tensor(_DTYPE_NAME[dtype], shape, _array(_ARRAY_CODE[dtype], dense or b"", param))


def _map_entry(buf: bytes) -> tuple[str, int | bytes | None]:
    key, value = "", None
    for n, v in fields(buf):
        if n == 1:
            key = v.decode() if isinstance(v, bytes) else str(v)
        elif n == 2:
            value = v
    return key, value


@dataclass
class Datum:
    tokens: list[int]
    loss_fn_inputs: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)


def _datum(buf: bytes, index: int) -> Datum:
    d = Datum(tokens=[])
    for n, v in fields(buf):
        if n == 1:
            for cn, cv in fields(v):
                if cn == 1:
                    for tn, tv in fields(cv):
                        if tn == 1:
                            d.tokens += _array("i", tv, f"data[{index}].model_input")
                else:
                    kind = {2: "image", 3: "audio (dmel)"}.get(cn, f"field {cn}")
                    raise WireError(f"{kind} chunks are not supported: memfit trains text models (encoded_text chunks only)",
                                    f"data[{index}].model_input")
        elif n == 2:
            key, value = _map_entry(v)
            d.loss_fn_inputs[key] = _tensor(value or b"", f"data[{index}].loss_fn_inputs.{key}")
    return d


def decode_forward_backward(body: bytes) -> ForwardBackwardRequest:
    r = ForwardBackwardRequest()
    for n, v in fields(body):
        if n == 1:
            r.model_id = v.decode()
        elif n == 2:
            r.seq_id = v
        elif n == 3:
            r.data.append(_datum(v, len(r.data)))
        elif n == 4:
            r.loss_fn = v.decode()
        elif n == 5:
            key, value = _map_entry(v)
            r.loss_fn_config.setdefault(key, struct.unpack("<d", (value or 0).to_bytes(8, "little"))[0])
        elif n == 6:
            r.forward_only = bool(v)
        elif n == 7:  # v2 wins over the legacy float map
            key, value = _map_entry(v)
            for cn, cv in fields(value or b""):
                r.loss_fn_config[key] = struct.unpack("<d", cv.to_bytes(8, "little"))[0] if cn == 1 else cv.decode()
    return r


# --- writing ------------------------------------------------------------------------------------------


def _put_varint(out: bytearray, v: int) -> None:
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return


def _key(out: bytearray, number: int, wire: int) -> None:
    _put_varint(out, number << 3 | wire)


def _bytes(out: bytearray, number: int, data: bytes) -> None:
    _key(out, number, 2)
    _put_varint(out, len(data))
    out += data


def _int(out: bytearray, number: int, v: int) -> None:
    _key(out, number, 0)
    _put_varint(out, v)


def _packed(code: str, values) -> bytes:
    a = array(code, values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def encode_forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord of per-datum float32 fields (``logprobs``, ``elementwise_loss``), and the metrics."""
    out = bytearray()
    _bytes(out, 1, b"ArrayRecord")
    record = bytearray()
    _bytes(record, 1, b"ArrayRecord")
    names = sorted({k for o in outputs for k in o})
    for name in names:
        offsets, data = [0], []
        for o in outputs:
            data += o.get(name, [])
            offsets.append(len(data) * 4)
        batched = bytearray()
        _bytes(batched, 1, _packed("f", data))
        _bytes(batched, 2, _packed("q", offsets))
        _int(batched, 3, DTYPE_FLOAT32)
        entry = bytearray()
        _bytes(entry, 1, name.encode())
        _bytes(entry, 2, bytes(batched))
        _bytes(record, 2, bytes(entry))
    _int(record, 3, len(outputs))
    _bytes(out, 2, bytes(record))
    for k, v in metrics.items():
        entry = bytearray()
        _bytes(entry, 1, k.encode())
        _key(entry, 2, 1)
        entry += struct.pack("<d", float(v))
        _bytes(out, 3, bytes(entry))
    return bytes(out)


def encode_sample_response(sequences: list[dict]) -> bytes:
    """``sequences``: ``{tokens, logprobs, stop_reason}`` each (stop_reason ``stop`` or ``length``)."""
    out = bytearray()
    for s in sequences:
        seq = bytearray()
        _int(seq, 1, STOP_REASON[s["stop_reason"]])
        _bytes(seq, 2, _packed("i", s["tokens"]))
        if s.get("logprobs") is not None:
            _bytes(seq, 3, _packed("f", s["logprobs"]))
        _bytes(out, 1, bytes(seq))
    return bytes(out)

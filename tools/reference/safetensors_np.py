"""Safetensors files written and read with numpy alone, and BF16 bit patterns: shared by the fixture scripts
that build their reference checkpoints without torch (kimi_linear_fixtures.py, deepseek_v4_fixtures.py)."""
import json
import struct

import numpy as np

NP_OF = {"BF16": "<u2", "F32": "<f4", "I64": "<i8"}


def to_bf16_bits(x):
    """float32 values -> bf16 bit patterns (uint16), round to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> (dtype, array already in that dtype's numpy layout). Returns the data size in bytes."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        dt, arr = tensors[name]
        raw = np.ascontiguousarray(arr, dtype=NP_OF[dt]).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for raw in blobs:
            f.write(raw)
    return off


def read_safetensors(path):
    """-> (name -> (dtype, array), metadata). BF16 comes back as uint16 bit patterns."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    meta = header.pop("__metadata__", None)
    out, base, end = {}, 8 + hlen, 0
    for name, e in header.items():
        a, b = e["data_offsets"]
        arr = np.frombuffer(data[base + a:base + b], dtype=NP_OF[e["dtype"]]).reshape(e["shape"])
        out[name] = (e["dtype"], arr)
        end = max(end, b)
    if base + end != len(data):
        raise ValueError(f"{path}: {len(data) - base - end} trailing bytes")
    return out, meta

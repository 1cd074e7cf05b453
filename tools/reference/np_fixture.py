"""What the fixture scripts that build their reference checkpoints with numpy alone (kimi_linear_fixtures.py,
deepseek_v4_fixtures.py) share: safetensors files written and read, BF16 bit patterns, random weights stored
as the files hold them, a sharded checkpoint, float64 activations."""
import json
import os
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


def store(name, x, dt, stored, W, order):
    """Keep random values x as dtype dt ("BF16", round to nearest even, or "F32"): stored[name] = the file's
    array, W[name] = the float64 of exactly those values; name joins order."""
    x32 = np.asarray(x).astype(np.float32)
    if dt == "BF16":
        bits = to_bf16_bits(x32)
        stored[name] = ("BF16", bits)
        W[name] = from_bf16_bits(bits).astype(np.float64)
    else:
        stored[name] = ("F32", x32)
        W[name] = x32.astype(np.float64)
    order.append(name)


def write_model(out, config, stored, order, n_shards):
    """config.json, the tensors in n_shards files (contiguous in creation order, about equal) and the index."""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    sizes = [stored[n][1].nbytes for n in order]
    total, acc, shard_of = sum(sizes), 0, {}
    for n, sz in zip(order, sizes):
        shard_of[n] = min(n_shards - 1, acc * n_shards // total)
        acc += sz
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    for i, fn in enumerate(files):
        write_safetensors(os.path.join(out, fn), {n: stored[n] for n in order if shard_of[n] == i},
                          {"format": "pt"})
    index = {"metadata": {"total_size": total},
             "weight_map": {n: files[shard_of[n]] for n in sorted(order)}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return files


def sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def lin(x, w):
    return x @ w.T


def top2_margin(row):
    a = np.sort(row)
    return float(a[-1] - a[-2])

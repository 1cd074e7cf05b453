"""Finding libdayzero and declaring its C API (include/dayzero.h) for ctypes.

The search order: the DAYZERO_LIB environment variable (a file, or a folder
holding the library), then pkg-config's libdir for `dayzero`, then the
dynamic loader's standard paths, then the build folders of a source checkout.
"""

import ctypes
import ctypes.util
import os
import subprocess

ABI_VERSION = 0  # DZ_ABI_VERSION of the header these declarations follow
_SONAME = "libdayzero.so.%d" % ABI_VERSION

c_int, c_int32, c_uint32, c_int64, c_uint64 = ctypes.c_int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64
c_size_t, c_float, c_char_p, c_void_p = ctypes.c_size_t, ctypes.c_float, ctypes.c_char_p, ctypes.c_void_p
P = ctypes.POINTER


class _Opaque(ctypes.Structure):
    _fields_ = []


class dz_model(_Opaque): pass
class dz_tokenizer(_Opaque): pass
class dz_detokenizer(_Opaque): pass
class dz_kv_arena(_Opaque): pass
class dz_session(_Opaque): pass


dz_status = c_int
dz_log_fn = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)
dz_progress_fn = ctypes.CFUNCTYPE(c_int, c_char_p, c_uint64, c_uint64, c_void_p)
dz_abort_fn = ctypes.CFUNCTYPE(c_int, c_void_p)


class dz_model_params(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("device", c_int), ("device_index", c_int), ("n_threads", c_int),
                ("experts", c_int), ("indexer", c_int), ("bf16_sensitive", c_int),
                ("progress", dz_progress_fn), ("progress_user", c_void_p), ("activations", c_int),
                ("exact_moe_layers", c_int), ("attention", c_int), ("pass_tokens", c_uint32)]


class dz_model_info(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("architecture", c_char_p), ("device", c_int),
                ("n_layers", c_int32), ("n_vocab", c_int32), ("hidden_size", c_int32), ("n_heads", c_int32),
                ("n_kv_heads", c_int32), ("n_experts", c_int32), ("n_experts_active", c_int32),
                ("max_context", c_int64), ("n_params", c_uint64), ("weight_bytes", c_uint64),
                ("device_bytes", c_uint64), ("n_shards", c_int32)]


class dz_kv_arena_params(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("page_tokens", c_uint32), ("capacity_pages", c_uint64),
                ("capacity_bytes", c_uint64), ("max_sessions", c_uint32), ("prefix_cache", c_int)]


class dz_kv_stats(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("page_tokens", c_uint32), ("page_bytes", c_uint64),
                ("pages_total", c_uint64), ("pages_used", c_uint64), ("pages_cached", c_uint64),
                ("pages_free", c_uint64), ("bytes_total", c_uint64), ("bytes_metadata", c_uint64),
                ("tokens_requested", c_uint64), ("tokens_reused", c_uint64), ("evictions", c_uint64),
                ("state_slots_total", c_uint32), ("state_slots_used", c_uint32), ("state_bytes", c_uint64),
                ("state_snapshots_total", c_uint32), ("state_snapshots_used", c_uint32)]


class dz_sampler_params(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("temperature", c_float), ("top_k", c_int32), ("top_p", c_float),
                ("seed", c_uint64)]


class dz_session_params(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("sampler", dz_sampler_params), ("prefill_chunk", c_uint32),
                ("abort", dz_abort_fn), ("abort_user", c_void_p)]


class dz_session_stats(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("n_tokens", c_uint64), ("tokens_computed", c_uint64),
                ("tokens_reused", c_uint64), ("pages", c_uint64), ("attention_tokens_read", c_uint64)]


# name: (restype, argtypes), in the header's order.
PROTOTYPES = {
    "dz_version": (c_char_p, []),
    "dz_abi_version": (c_int, []),
    "dz_last_error": (c_char_p, []),
    "dz_status_name": (c_char_p, [dz_status]),
    "dz_log_set": (dz_status, [dz_log_fn, c_void_p, c_int]),
    "dz_model_params_init_sized": (None, [P(dz_model_params), c_size_t]),
    "dz_model_params_init": (None, [P(dz_model_params)]),
    "dz_model_open": (dz_status, [c_char_p, P(dz_model_params), P(P(dz_model))]),
    "dz_model_free": (None, [P(dz_model)]),
    "dz_model_info_init_sized": (None, [P(dz_model_info), c_size_t]),
    "dz_model_info_init": (None, [P(dz_model_info)]),
    "dz_model_get_info": (dz_status, [P(dz_model), P(dz_model_info)]),
    "dz_tokenizer_open": (dz_status, [c_char_p, P(P(dz_tokenizer))]),
    "dz_tokenizer_free": (None, [P(dz_tokenizer)]),
    "dz_model_tokenizer": (dz_status, [P(dz_model), P(P(dz_tokenizer))]),
    "dz_tokenize": (dz_status, [P(dz_tokenizer), c_char_p, c_size_t, c_int, P(c_int32), c_size_t, P(c_size_t)]),
    "dz_detokenize": (dz_status, [P(dz_tokenizer), P(c_int32), c_size_t, c_void_p, c_size_t, P(c_size_t)]),
    "dz_tokenizer_vocab_size": (dz_status, [P(dz_tokenizer), P(c_int32)]),
    "dz_tokenizer_token_id": (dz_status, [P(dz_tokenizer), c_char_p, P(c_int32)]),
    "dz_tokenizer_stop_ids": (dz_status, [P(dz_tokenizer), P(P(c_int32)), P(c_size_t)]),
    "dz_detokenizer_create": (dz_status, [P(dz_tokenizer), P(P(dz_detokenizer))]),
    "dz_detokenizer_free": (None, [P(dz_detokenizer)]),
    "dz_detokenizer_push": (dz_status, [P(dz_detokenizer), c_int32, P(c_void_p), P(c_size_t)]),
    "dz_detokenizer_flush": (dz_status, [P(dz_detokenizer), P(c_void_p), P(c_size_t)]),
    "dz_chat_apply_template": (dz_status, [P(dz_tokenizer), c_char_p, c_char_p, c_int, c_void_p, c_size_t,
                                           P(c_size_t)]),
    "dz_kv_arena_params_init_sized": (None, [P(dz_kv_arena_params), c_size_t]),
    "dz_kv_arena_params_init": (None, [P(dz_kv_arena_params)]),
    "dz_kv_arena_create": (dz_status, [P(dz_model), P(dz_kv_arena_params), P(P(dz_kv_arena))]),
    "dz_kv_arena_free": (None, [P(dz_kv_arena)]),
    "dz_kv_stats_init_sized": (None, [P(dz_kv_stats), c_size_t]),
    "dz_kv_stats_init": (None, [P(dz_kv_stats)]),
    "dz_kv_arena_get_stats": (dz_status, [P(dz_kv_arena), P(dz_kv_stats)]),
    "dz_sampler_params_init_sized": (None, [P(dz_sampler_params), c_size_t]),
    "dz_sampler_params_init": (None, [P(dz_sampler_params)]),
    "dz_session_params_init_sized": (None, [P(dz_session_params), c_size_t]),
    "dz_session_params_init": (None, [P(dz_session_params)]),
    "dz_session_create": (dz_status, [P(dz_kv_arena), P(dz_session_params), P(P(dz_session))]),
    "dz_session_free": (None, [P(dz_session)]),
    "dz_session_fork": (dz_status, [P(dz_session), P(P(dz_session))]),
    "dz_session_append": (dz_status, [P(dz_session), P(c_int32), c_size_t, c_int]),
    "dz_session_logits": (dz_status, [P(dz_session), P(P(c_float)), P(c_size_t), P(c_size_t)]),
    "dz_session_sample": (dz_status, [P(dz_session), P(c_int32)]),
    "dz_session_set_sampler": (dz_status, [P(dz_session), P(dz_sampler_params)]),
    "dz_session_length": (dz_status, [P(dz_session), P(c_size_t)]),
    "dz_session_truncate": (dz_status, [P(dz_session), c_size_t]),
    "dz_session_reset": (dz_status, [P(dz_session)]),
    "dz_session_stats_init_sized": (None, [P(dz_session_stats), c_size_t]),
    "dz_session_stats_init": (None, [P(dz_session_stats)]),
    "dz_session_get_stats": (dz_status, [P(dz_session), P(dz_session_stats)]),
    "dz_generate_step": (dz_status, [P(P(dz_session)), c_size_t, P(c_int32)]),
    "dz_decode_batch": (dz_status, [P(P(dz_session)), P(c_int32), c_size_t]),
}

# Params/info structs and their init functions. The *_init_sized form is given ctypes.sizeof of the
# declaration above, so a newer library writing a longer struct never writes past ours (the header's
# *_init macros do the same with sizeof). The unsized *_init write the library's own sizeof.
STRUCT_INITS = {
    dz_model_params: "dz_model_params_init_sized",
    dz_model_info: "dz_model_info_init_sized",
    dz_kv_arena_params: "dz_kv_arena_params_init_sized",
    dz_kv_stats: "dz_kv_stats_init_sized",
    dz_sampler_params: "dz_sampler_params_init_sized",
    dz_session_params: "dz_session_params_init_sized",
    dz_session_stats: "dz_session_stats_init_sized",
}


def _pkg_config_libdir():
    try:
        r = subprocess.run(["pkg-config", "--variable=libdir", "dayzero"], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    d = r.stdout.strip()
    return d if r.returncode == 0 and d else None


def _in_dir(d):
    for name in (_SONAME, "libdayzero.so"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            return p
    return None


def candidates():
    """Library paths to try, in order, each with how it was found."""
    out = []
    env = os.environ.get("DAYZERO_LIB")
    if env:
        # An explicit choice is the only candidate: a wrong value must fail, not fall through.
        return [((_in_dir(env) or env) if os.path.isdir(env) else env, "DAYZERO_LIB")]
    d = _pkg_config_libdir()
    if d and _in_dir(d):
        out.append((_in_dir(d), "pkg-config"))
    out.append((_SONAME, "the loader's standard paths"))
    found = ctypes.util.find_library("dayzero")
    if found:
        out.append((found, "ldconfig"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for b in ("build", "build-cpu", "build-gpu"):
        p = _in_dir(os.path.join(root, b))
        if p:
            out.append((p, "the source checkout's " + b + "/"))
    return out


def load():
    """Load libdayzero, declare its functions, check its ABI version."""
    tried = []
    for path, how in candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append("%s (%s): %s" % (path, how, e))
            continue
        for name, (res, args) in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        abi = lib.dz_abi_version()
        if abi != ABI_VERSION:
            raise ImportError("%s has ABI version %d; this package needs %d" % (path, abi, ABI_VERSION))
        lib._dz_path = path
        return lib
    raise ImportError("libdayzero not found; set DAYZERO_LIB to the library file, or install dayzero where "
                      "pkg-config finds it. Tried:\n  " + "\n  ".join(tried))

"""dayzero for Python: a pure-ctypes binding of libdayzero's C API.

    import dayzero
    with dayzero.Model("path/to/model") as model, model.session() as s:
        for piece in s.generate("Hello", max_tokens=16):
            print(piece, end="", flush=True)

Handles close in dependency order: closing a model closes its arenas and
sessions first. A model and its tokenizer may be used from any thread; a
session or detokenizer from one thread at a time (the C API's rules).
"""

import ctypes
import enum
import json
import weakref

from . import _lib as _c

try:  # logits come back as numpy arrays when numpy is importable
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None

__all__ = ["Status", "Device", "Experts", "Indexer", "LogLevel", "DayzeroError", "Model", "ModelInfo", "Tokenizer",
           "Detokenizer", "KVArena", "Session", "generate_step", "set_log", "version", "abi_version", "library_path"]

_L = _c.load()


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    IO = 2
    FORMAT = 3
    UNSUPPORTED = 4
    OUT_OF_MEMORY = 5
    KV_FULL = 6
    CANCELLED = 7
    DEVICE = 8
    NOT_FOUND = 9
    BUFFER_TOO_SMALL = 10
    INTERNAL = 11


class Device(enum.IntEnum):
    CPU = 0
    CUDA = 1
    AUTO = 2


class Experts(enum.IntEnum):
    AUTO = 0
    NATIVE = 1
    FP8 = 2
    BF16 = 3


class Indexer(enum.IntEnum):
    EXACT = 0
    FP8 = 1
    AUTO = 2  # the backend's own: CPU exact, CUDA FP8


class LogLevel(enum.IntEnum):
    DEBUG = 0
    INFO = 1
    WARN = 2
    ERROR = 3
    NONE = 4


class DayzeroError(Exception):
    """A failing dayzero call: .status (Status), .status_name ("DZ_ERR_IO") and .message (dz_last_error())."""

    def __init__(self, status, message):
        try:
            self.status = Status(status)
        except ValueError:
            self.status = status
        self.status_name = _L.dz_status_name(int(status)).decode()
        self.message = message
        super().__init__("%s: %s" % (self.status_name, message))


def _check(status):
    if status != 0:
        raise DayzeroError(status, (_L.dz_last_error() or b"").decode("utf-8", "replace"))


def version():
    """The loaded library's "MAJOR.MINOR.PATCH"."""
    return _L.dz_version().decode()


def abi_version():
    return _L.dz_abi_version()


def library_path():
    """The libdayzero file this package loaded."""
    return _L._dz_path


def _init(struct_type):
    """A struct_type with the library's defaults, written into no more than ctypes.sizeof(struct_type) bytes."""
    s = struct_type()
    getattr(_L, _c.STRUCT_INITS[struct_type])(ctypes.byref(s), ctypes.sizeof(struct_type))
    return s


def _to_dict(s):
    return {name: getattr(s, name) for name, _ in s._fields_ if name != "struct_size"}


_log_keep = None  # the ctypes callback must outlive its registration


def set_log(fn=None, level=LogLevel.WARN):
    """Route library log lines at or above level to fn(level: LogLevel, message: str); None: stderr.
    Call at start-up, before other threads use the library."""
    global _log_keep
    cb = _c.dz_log_fn(0)
    if fn is not None:
        def tramp(lvl, msg, _user):
            fn(LogLevel(lvl), msg.decode("utf-8", "replace"))
        cb = _c.dz_log_fn(tramp)
    _check(_L.dz_log_set(cb, None, int(level)))
    _log_keep = cb


class _Handle:
    """An owned C handle: close() frees it once (children first); use after close raises ValueError."""

    _free = None

    def __init__(self):
        self._ptr = None
        self._children = weakref.WeakSet()

    def _get(self):
        if not self._ptr:
            raise ValueError("%s is closed" % type(self).__name__)
        return self._ptr

    def close(self):
        for child in list(self._children):
            child.close()
        if self._ptr:
            ptr, self._ptr = self._ptr, None
            getattr(_L, self._free)(ptr)

    @property
    def closed(self):
        return not self._ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ModelInfo:
    """dz_model_info as attributes (architecture, n_layers, n_vocab, ...)."""

    def __init__(self, info):
        self.__dict__.update(_to_dict(info))
        self.architecture = info.architecture.decode() if info.architecture else ""
        self.device = Device(info.device)

    def __repr__(self):
        return "ModelInfo(%s)" % ", ".join("%s=%r" % kv for kv in self.__dict__.items())


class Model(_Handle):
    """A model opened from a Hugging Face directory. Immutable; usable from any thread."""

    _free = "dz_model_free"

    def __init__(self, path, device=Device.CPU, device_index=0, n_threads=0, experts=Experts.AUTO,
                 indexer=Indexer.AUTO, bf16_sensitive=True, progress=None):
        """progress: optional fn(stage: str, done: int, total: int) -> bool; return True to cancel."""
        super().__init__()
        p = _init(_c.dz_model_params)
        if isinstance(device, str):
            device = Device[device.upper()]
        p.device, p.device_index, p.n_threads = int(device), device_index, n_threads
        p.experts, p.indexer, p.bf16_sensitive = int(experts), int(indexer), int(bool(bf16_sensitive))
        if progress is not None:
            def tramp(stage, done, total, _user):
                return 1 if progress(stage.decode(), done, total) else 0
            p.progress = _c.dz_progress_fn(tramp)
        out = ctypes.POINTER(_c.dz_model)()
        _check(_L.dz_model_open(str(path).encode(), ctypes.byref(p), ctypes.byref(out)))
        self._ptr = out
        self.path = str(path)
        self._tokenizer = False  # not looked up yet

    @property
    def info(self):
        info = _init(_c.dz_model_info)
        _check(_L.dz_model_get_info(self._get(), ctypes.byref(info)))
        return ModelInfo(info)

    @property
    def tokenizer(self):
        """The model's Tokenizer, or None when the directory has none."""
        if self._tokenizer is False:
            out = ctypes.POINTER(_c.dz_tokenizer)()
            st = _L.dz_model_tokenizer(self._get(), ctypes.byref(out))
            if st in (Status.NOT_FOUND, Status.UNSUPPORTED):
                self._tokenizer = None
            else:
                _check(st)
                self._tokenizer = Tokenizer._borrowed(out, self)
        return self._tokenizer

    def arena(self, **kwargs):
        """A new KVArena for this model (see KVArena for the options)."""
        return KVArena(self, **kwargs)

    def session(self, arena=None, arena_options=None, **kwargs):
        """A new Session (see Session for the options); without an arena, one is made for it with
        arena_options (a dict of KVArena options) and closed with it."""
        if arena is None:
            arena = KVArena(self, **(arena_options or {}))
            s = Session(arena, **kwargs)
            s._own_arena = arena
            return s
        return Session(arena, **kwargs)

    def __repr__(self):
        return "<dayzero.Model %r%s>" % (self.path, " closed" if self.closed else "")


class Tokenizer(_Handle):
    """A tokenizer: Tokenizer(path) opens a tokenizer.json / tiktoken.model; Model.tokenizer is the model's."""

    _free = "dz_tokenizer_free"

    def __init__(self, path):
        super().__init__()
        out = ctypes.POINTER(_c.dz_tokenizer)()
        _check(_L.dz_tokenizer_open(str(path).encode(), ctypes.byref(out)))
        self._ptr = out
        self._owner = None

    @classmethod
    def _borrowed(cls, ptr, owner):
        t = cls.__new__(cls)
        _Handle.__init__(t)
        t._ptr, t._owner = ptr, owner
        t._free = None
        owner._children.add(t)
        return t

    def close(self):
        if self._owner is not None:  # owned by the model: only forget it
            for child in list(self._children):
                child.close()
            self._ptr = None
            return
        super().close()

    def encode(self, text, parse_special=False):
        """Token ids (list of int) of text (str or bytes)."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        n = ctypes.c_size_t()
        cap = max(16, len(data) + 8)
        while True:
            buf = (ctypes.c_int32 * cap)()
            st = _L.dz_tokenize(self._get(), data, len(data), int(parse_special), buf, cap, ctypes.byref(n))
            if st == Status.BUFFER_TOO_SMALL and n.value > cap:
                cap = n.value
                continue
            _check(st)
            return list(buf[:n.value])

    def _bytes_call(self, fn, *args):
        n = ctypes.c_size_t()
        cap = 256
        while True:
            buf = ctypes.create_string_buffer(cap)
            st = fn(*args, buf, cap, ctypes.byref(n))
            if st == Status.BUFFER_TOO_SMALL and n.value > cap:
                cap = n.value
                continue
            _check(st)
            return buf.raw[:n.value].decode("utf-8", "replace")

    def decode(self, ids):
        ids = list(ids)
        arr = (ctypes.c_int32 * len(ids))(*ids)
        return self._bytes_call(_L.dz_detokenize, self._get(), arr, len(ids))

    def apply_chat_template(self, messages, add_generation_prompt=True, **options):
        """Render messages (a list of {"role", "content"} dicts) through the chat template; options become
        extra template variables (e.g. tools=[...])."""
        opts = json.dumps(options).encode() if options else None
        return self._bytes_call(_L.dz_chat_apply_template, self._get(), json.dumps(messages).encode(), opts,
                                int(bool(add_generation_prompt)))

    @property
    def vocab_size(self):
        n = ctypes.c_int32()
        _check(_L.dz_tokenizer_vocab_size(self._get(), ctypes.byref(n)))
        return n.value

    def token_id(self, text):
        """Id of a token's exact text, or None when there is none."""
        i = ctypes.c_int32()
        st = _L.dz_tokenizer_token_id(self._get(), text.encode(), ctypes.byref(i))
        if st == Status.NOT_FOUND:
            return None
        _check(st)
        return i.value

    @property
    def stop_ids(self):
        """Ids that end generation (eos and the chat template's stop tokens)."""
        p = ctypes.POINTER(ctypes.c_int32)()
        n = ctypes.c_size_t()
        _check(_L.dz_tokenizer_stop_ids(self._get(), ctypes.byref(p), ctypes.byref(n)))
        return [p[i] for i in range(n.value)]

    def detokenizer(self):
        return Detokenizer(self)


class Detokenizer(_Handle):
    """Streaming decoder: push(id) returns the text now complete (never a split UTF-8 character)."""

    _free = "dz_detokenizer_free"

    def __init__(self, tokenizer):
        super().__init__()
        out = ctypes.POINTER(_c.dz_detokenizer)()
        _check(_L.dz_detokenizer_create(tokenizer._get(), ctypes.byref(out)))
        self._ptr = out
        self._tokenizer = tokenizer
        tokenizer._children.add(self)

    def push(self, token):
        piece = ctypes.c_void_p()
        n = ctypes.c_size_t()
        _check(_L.dz_detokenizer_push(self._get(), int(token), ctypes.byref(piece), ctypes.byref(n)))
        return ctypes.string_at(piece, n.value).decode("utf-8", "replace") if n.value else ""

    def flush(self):
        """End of stream: what push held back (an incomplete UTF-8 sequence as U+FFFD)."""
        piece = ctypes.c_void_p()
        n = ctypes.c_size_t()
        _check(_L.dz_detokenizer_flush(self._get(), ctypes.byref(piece), ctypes.byref(n)))
        return ctypes.string_at(piece, n.value).decode("utf-8", "replace") if n.value else ""


class KVArena(_Handle):
    """The paged KV pool sessions draw from. Internally synchronised: sessions on several threads may share it."""

    _free = "dz_kv_arena_free"

    def __init__(self, model, page_tokens=0, capacity_pages=0, capacity_bytes=0, max_sessions=0, prefix_cache=True):
        super().__init__()
        p = _init(_c.dz_kv_arena_params)
        p.page_tokens, p.capacity_pages, p.capacity_bytes = page_tokens, capacity_pages, capacity_bytes
        p.max_sessions, p.prefix_cache = max_sessions, int(bool(prefix_cache))
        out = ctypes.POINTER(_c.dz_kv_arena)()
        _check(_L.dz_kv_arena_create(model._get(), ctypes.byref(p), ctypes.byref(out)))
        self._ptr = out
        self.model = model
        model._children.add(self)

    def stats(self):
        """dz_kv_stats as a dict (pages_used, pages_free, tokens_reused, ...)."""
        s = _init(_c.dz_kv_stats)
        _check(_L.dz_kv_arena_get_stats(self._get(), ctypes.byref(s)))
        return _to_dict(s)

    def session(self, **kwargs):
        return Session(self, **kwargs)


def _ids(tokens):
    tokens = [int(t) for t in tokens]
    return (ctypes.c_int32 * len(tokens))(*tokens), len(tokens)


def _sampler(temperature=0.0, top_k=0, top_p=1.0, seed=0):
    s = _init(_c.dz_sampler_params)
    s.temperature, s.top_k, s.top_p, s.seed = temperature, top_k, top_p, seed
    return s


class Session(_Handle):
    """One sequence in a KVArena with its sampler. Use from one thread at a time.

    Sampler options: temperature (<= 0: greedy, the default), top_k (0: off), top_p (1: off), seed.
    abort: optional fn() -> bool polled between layers; True stops the running call (DayzeroError CANCELLED).
    """

    _free = "dz_session_free"

    def __init__(self, arena, temperature=0.0, top_k=0, top_p=1.0, seed=0, prefill_chunk=0, abort=None):
        super().__init__()
        p = _init(_c.dz_session_params)
        p.sampler = _sampler(temperature, top_k, top_p, seed)
        p.prefill_chunk = prefill_chunk
        self._abort = None
        if abort is not None:
            self._abort = _c.dz_abort_fn(lambda _user: 1 if abort() else 0)
            p.abort = self._abort
        out = ctypes.POINTER(_c.dz_session)()
        _check(_L.dz_session_create(arena._get(), ctypes.byref(p), ctypes.byref(out)))
        self._init_from(out, arena)

    def _init_from(self, ptr, arena):
        self._ptr = ptr
        self.arena = arena
        self._own_arena = None
        arena._children.add(self)

    def close(self):
        super().close()
        arena, self._own_arena = getattr(self, "_own_arena", None), None
        if arena is not None:
            arena.close()

    def fork(self):
        """A copy sharing this session's pages copy-on-write (same arena, same sampler)."""
        out = ctypes.POINTER(_c.dz_session)()
        _check(_L.dz_session_fork(self._get(), ctypes.byref(out)))
        s = Session.__new__(Session)
        _Handle.__init__(s)
        s._abort = self._abort
        s._init_from(out, self.arena)
        return s

    def append(self, tokens, all_logits=False):
        """Append token ids and run the model over them; logits of the last token (or all with all_logits)."""
        arr, n = _ids(tokens)
        _check(_L.dz_session_append(self._get(), arr, n, 1 if all_logits else 0))

    def logits(self):
        """A copy of the last append's logits, rows x n_vocab float32: a numpy array when numpy is importable,
        else a 2-D memoryview."""
        p = ctypes.POINTER(ctypes.c_float)()
        rows, nv = ctypes.c_size_t(), ctypes.c_size_t()
        _check(_L.dz_session_logits(self._get(), ctypes.byref(p), ctypes.byref(rows), ctypes.byref(nv)))
        count = rows.value * nv.value
        raw = ctypes.string_at(p, count * 4) if count else b""
        if _np is not None:
            return _np.frombuffer(raw, dtype=_np.float32).reshape(rows.value, nv.value).copy()
        return memoryview(bytearray(raw)).cast("f", (rows.value, nv.value))

    def sample(self):
        """Sample the next id from the last logits row (does not append it)."""
        t = ctypes.c_int32()
        _check(_L.dz_session_sample(self._get(), ctypes.byref(t)))
        return t.value

    def set_sampler(self, temperature=0.0, top_k=0, top_p=1.0, seed=0):
        _check(_L.dz_session_set_sampler(self._get(), ctypes.byref(_sampler(temperature, top_k, top_p, seed))))

    def step(self):
        """Sample the next id, append it and compute its logits; returns the id."""
        return generate_step([self])[0]

    def __len__(self):
        n = ctypes.c_size_t()
        _check(_L.dz_session_length(self._get(), ctypes.byref(n)))
        return n.value

    def truncate(self, n):
        _check(_L.dz_session_truncate(self._get(), n))

    def reset(self):
        _check(_L.dz_session_reset(self._get()))

    def stats(self):
        s = _init(_c.dz_session_stats)
        _check(_L.dz_session_get_stats(self._get(), ctypes.byref(s)))
        return _to_dict(s)

    def generate_tokens(self, prompt=(), max_tokens=256, stop=None):
        """Append prompt (ids, or text when the model has a tokenizer), then yield up to max_tokens ids, each
        sampled, appended and run (dz_generate_step). Stops after an id in stop (default: the tokenizer's
        stop ids, none without a tokenizer); that id is yielded too."""
        tok = self.arena.model.tokenizer
        if isinstance(prompt, (str, bytes)):
            if tok is None:
                raise ValueError("the model has no tokenizer: pass the prompt as token ids")
            prompt = tok.encode(prompt)
        if stop is None:
            stop = tok.stop_ids if tok is not None else ()
        stop = frozenset(stop)
        if len(prompt):
            self.append(prompt)
        for _ in range(max_tokens):
            t = self.step()
            yield t
            if t in stop:
                return

    def generate(self, prompt=(), max_tokens=256, stop=None):
        """Streaming generation: yields text pieces (str) when the model has a tokenizer, else token ids.
        A stop id ends the stream without being shown. See generate_tokens for the arguments."""
        tok = self.arena.model.tokenizer
        if tok is None:
            yield from self.generate_tokens(prompt, max_tokens, stop)
            return
        stop_set = frozenset(tok.stop_ids if stop is None else stop)
        with tok.detokenizer() as d:
            for t in self.generate_tokens(prompt, max_tokens, stop_set):
                if t in stop_set:
                    return
                piece = d.push(t)
                if piece:
                    yield piece


def generate_step(sessions):
    """One decode step for several sessions of one arena (continuous batching): each samples its next id,
    appends it and computes its logits. Returns the ids."""
    sessions = list(sessions)
    arr = (ctypes.POINTER(_c.dz_session) * len(sessions))(*[s._get() for s in sessions])
    out = (ctypes.c_int32 * len(sessions))()
    _check(_L.dz_generate_step(arr, len(sessions), out))
    return list(out)


def decode_batch(sessions, tokens):
    """Append one given id to each session, batched (forced decoding)."""
    sessions = list(sessions)
    arr = (ctypes.POINTER(_c.dz_session) * len(sessions))(*[s._get() for s in sessions])
    ids, n = _ids(tokens)
    if n != len(sessions):
        raise ValueError("decode_batch: %d sessions but %d tokens" % (len(sessions), n))
    _check(_L.dz_decode_batch(arr, ids, n))

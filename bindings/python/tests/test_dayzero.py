"""The Python binding against the tiny fixture model. Greedy generation is compared with the C API's
tokens: the C example program (examples/simple/simple.c) run on the same prompt in the same test run."""

import ctypes
import os
import re
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)
sys.path.insert(0, PKG_ROOT)

import dayzero  # noqa: E402
from dayzero import _lib  # noqa: E402

PROMPT = [2, 17, 300, 45, 8, 99]
N_GEN = 8
SMALL = {"capacity_bytes": 8 << 20}  # a small KV arena: quick to set up


def env(name):
    v = os.environ.get(name)
    if not v:
        raise AssertionError("%s is not set (ctest sets it; see tests/bindings.cmake)" % name)
    return v


_reference = {}


def reference(model=None, prompt=PROMPT, n=N_GEN):
    """(ids, text bytes) the C example program prints for prompt on model; computed once per input (every
    process loading libdayzero costs start-up time)."""
    key = (model or env("DAYZERO_TEST_MODEL"), tuple(prompt), n)
    if key not in _reference:
        r = subprocess.run([env("DAYZERO_TEST_REFERENCE"), key[0], str(n)] + [str(t) for t in prompt],
                           capture_output=True)
        out = r.stdout.decode("utf-8", "replace")
        if r.returncode != 0:
            raise AssertionError("reference program failed:\n" + out + r.stderr.decode())
        line = [l for l in out.splitlines() if l.startswith("generated:")]
        if not line:
            raise AssertionError("no 'generated:' line in:\n" + out)
        ids = [int(x) for x in line[0].split()[1:]]
        assert len(ids) == n, out
        # "text: " is the last line (when the model has a tokenizer); the text itself may hold newlines.
        text = r.stdout.split(b"\ntext: ", 1)[1][:-1] if b"\ntext: " in r.stdout else None
        _reference[key] = (ids, text)
    return _reference[key]


def reference_ids():
    return reference()[0]


def header_text():
    with open(env("DAYZERO_TEST_HEADER")) as f:
        return re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)


class TestLibrary(unittest.TestCase):
    def test_version_matches_header(self):
        h = header_text()
        want = ".".join(re.search(r"#define DZ_VERSION_%s (\d+)" % k, h).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
        self.assertEqual(dayzero.version(), want)
        self.assertEqual(dayzero.abi_version(), int(re.search(r"#define DZ_ABI_VERSION (\d+)", h).group(1)))

    def test_found_through_pkg_config(self):
        # ctest points PKG_CONFIG_PATH at the test install and leaves DAYZERO_LIB unset.
        prefix = os.path.realpath(env("DAYZERO_TEST_PREFIX"))
        self.assertNotIn("DAYZERO_LIB", os.environ)
        self.assertTrue(os.path.realpath(dayzero.library_path()).startswith(prefix + os.sep),
                        "%s is not under %s" % (dayzero.library_path(), prefix))

    def test_a_bad_dayzero_lib_fails(self):
        r = subprocess.run([sys.executable, "-c", "import dayzero"], cwd=PKG_ROOT, capture_output=True, text=True,
                           env=dict(os.environ, DAYZERO_LIB="/nonexistent/libdayzero.so"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("/nonexistent/libdayzero.so", r.stderr)
        self.assertIn("DAYZERO_LIB", r.stderr)

    def test_declarations_match_header(self):
        h = header_text()
        # `DZ_API T dz_f(` or, where a macro of that name routes to dz_f_sized, `DZ_API T (dz_f)(`.
        declared = set(re.findall(r"DZ_API[^;(]*?\(?\b(dz_\w+)\)?\s*\(", h))
        self.assertEqual(declared, set(_lib.PROTOTYPES), "ctypes prototypes differ from the header's functions")
        for struct, init in _lib.STRUCT_INITS.items():
            name = struct.__name__
            body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), h, re.S).group(1)
            fields = [re.search(r"(\w+)\s*$", d.strip()).group(1) for d in body.split(";") if d.strip()]
            self.assertEqual([f for f, _ in struct._fields_], fields, name)
            self.assertEqual(init, name + "_init_sized")
            self.assertIn("#define %s_init(p) %s((p), sizeof *(p))" % (name, init), h)
            size = ctypes.sizeof(struct)
            # The unsized *_init writes the library's sizeof into struct_size: it must be ours.
            buf = ctypes.create_string_buffer(b"\xab" * 1024, 1024)
            getattr(dayzero._L, name + "_init")(ctypes.cast(buf, ctypes.POINTER(struct)))
            self.assertEqual(ctypes.c_size_t.from_buffer(buf).value, size, name)
            # *_init_sized writes no byte past the size it is given: ours, or an older declaration's (one
            # field fewer), whose bytes are the full struct's.
            for n in (size, getattr(struct, struct._fields_[-1][0]).offset):
                cut = ctypes.create_string_buffer(b"\xab" * 1024, 1024)
                getattr(dayzero._L, init)(ctypes.cast(cut, ctypes.POINTER(struct)), n)
                self.assertEqual(ctypes.c_size_t.from_buffer(cut).value, n, name)
                self.assertEqual(cut.raw[n:], b"\xab" * (1024 - n), name)
                head = ctypes.sizeof(ctypes.c_size_t)
                self.assertEqual(cut.raw[head:n], buf.raw[head:n], name)
            # What the binding's own helper gives: the defaults, struct_size ours.
            self.assertEqual(dayzero._init(struct).struct_size, size, name)
        for enum_cls, c_enum in ((dayzero.Status, "dz_status"), (dayzero.Device, "dz_device"),
                                 (dayzero.LogLevel, "dz_log_level"), (dayzero.Experts, "dz_expert_precision"),
                                 (dayzero.Indexer, "dz_indexer_mode")):
            body = re.search(r"typedef enum %s \{(.*?)\}" % c_enum, h, re.S).group(1)
            values = sorted(int(v) for v in re.findall(r"=\s*(\d+)", body))
            self.assertEqual(sorted(int(m) for m in enum_cls), values, c_enum)

    def test_bad_path_raises_with_status_and_message(self):
        bad = os.path.join(tempfile.gettempdir(), "dayzero-no-such-model")
        with self.assertRaises(dayzero.DayzeroError) as cm:
            dayzero.Model(bad)
        e = cm.exception
        self.assertEqual(e.status, dayzero.Status.IO)
        self.assertEqual(e.status_name, "DZ_ERR_IO")
        self.assertIn(bad, e.message)
        self.assertIn(bad, str(e))


class TestModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.want = reference_ids()

    def setUp(self):
        self.model = dayzero.Model(env("DAYZERO_TEST_MODEL"))

    def tearDown(self):
        self.model.close()

    def test_greedy_generation_matches_c_api(self):
        with self.model.session(arena_options=SMALL) as s:
            got = list(s.generate_tokens(PROMPT, max_tokens=N_GEN, stop=()))
            self.assertEqual(got, self.want)
            self.assertEqual(len(s), len(PROMPT) + N_GEN)
        # generate(): ids without a tokenizer (this fixture has none), text pieces with one.
        tok = self.model.tokenizer
        with self.model.session(arena_options=SMALL) as s:
            pieces = list(s.generate(PROMPT, max_tokens=N_GEN, stop=()))
        if tok is None:
            self.assertEqual(pieces, self.want)
        else:
            self.assertEqual("".join(pieces), tok.decode(self.want))

    def test_info(self):
        info = self.model.info
        self.assertEqual(info.architecture, "gpt_oss")
        self.assertEqual(info.n_layers, 4)
        self.assertEqual(info.n_vocab, 512)

    def test_logits_step_fork_and_batch(self):
        with self.model.arena(**SMALL) as arena:
            s = arena.session()
            s.append(PROMPT)
            logits = s.logits()
            try:
                import numpy as np
            except ImportError:
                np = None
                if os.environ.get("DAYZERO_TEST_REQUIRE_NUMPY"):
                    raise
            if np is not None:
                self.assertIsInstance(logits, np.ndarray)
                self.assertEqual(logits.shape, (1, 512))
                self.assertEqual(logits.dtype, np.float32)
                self.assertEqual(int(np.argmax(logits[0])), self.want[0])
            f = s.fork()
            self.assertEqual(dayzero.generate_step([s, f]), [self.want[0]] * 2)
            self.assertEqual(s.step(), self.want[1])
            self.assertEqual(len(s), len(PROMPT) + 2)
            s.truncate(len(PROMPT))
            self.assertEqual(len(s), len(PROMPT))
            s.append(PROMPT[:2], all_logits=True)
            self.assertEqual(tuple(s.logits().shape), (2, 512))
            st = s.stats()
            self.assertEqual(st["n_tokens"], len(PROMPT) + 2)
            self.assertGreater(arena.stats()["pages_used"], 0)
        # Closing the arena closed its sessions.
        self.assertTrue(s.closed and f.closed)
        with self.assertRaises(ValueError):
            s.append(PROMPT)

    def test_decode_batch_equals_one_append_each(self):
        # Forced decoding of two sessions in one batched step = each appending its token alone.
        with self.model.arena(**SMALL) as arena:
            a, b, c = arena.session(), arena.session(), arena.session()
            a.append(PROMPT)
            b.append(PROMPT[:3])
            c.append(PROMPT)
            dayzero.decode_batch([a, b], [self.want[0], 7])
            c.append([self.want[0]])
            self.assertEqual((len(a), len(b)), (len(PROMPT) + 1, 4))
            la, lc = a.logits(), c.logits()
            self.assertEqual([list(r) for r in la], [list(r) for r in lc])
            with self.assertRaises(ValueError):
                dayzero.decode_batch([a, b], [1])

    def test_dayzero_lib_and_logits_without_numpy(self):
        # One subprocess (each process pays the library's load time): DAYZERO_LIB naming the library's
        # folder wins over pkg-config, and without numpy logits are a 2-D memoryview.
        lib = os.path.realpath(dayzero.library_path())
        code = ("import os, sys; sys.modules['numpy'] = None\n"
                "import dayzero\n"
                "print(os.path.realpath(dayzero.library_path()))\n"
                "with dayzero.Model(%r) as m, m.session(arena_options={'capacity_bytes': 8 << 20}) as s:\n"
                "    s.append(%r)\n"
                "    l = s.logits()\n"
                "    row = l.tolist()[0]\n"
                "    print(type(l).__name__, l.shape, row.index(max(row)))\n") % (env("DAYZERO_TEST_MODEL"), PROMPT)
        r = subprocess.run([sys.executable, "-c", code], cwd=PKG_ROOT, capture_output=True, text=True,
                           env=dict(os.environ, DAYZERO_LIB=os.path.dirname(lib), PKG_CONFIG_PATH="/nonexistent"))
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertEqual(os.path.dirname(lines[0]), os.path.dirname(lib))
        self.assertEqual(lines[1].split(), ["memoryview", "(1,", "512)", str(self.want[0])])

    def test_abort_cancels_and_session_is_unchanged(self):
        flag = [True]
        with self.model.session(arena_options=SMALL, abort=lambda: flag[0]) as s:
            with self.assertRaises(dayzero.DayzeroError) as cm:
                s.append(PROMPT)
            self.assertEqual(cm.exception.status, dayzero.Status.CANCELLED)
            self.assertEqual(len(s), 0)
            flag[0] = False
            s.append(PROMPT)
            self.assertEqual(s.sample(), self.want[0])

    def test_closing_the_model_closes_its_children(self):
        s = self.model.session(arena_options=SMALL)
        self.model.close()
        self.assertTrue(s.closed)
        with self.assertRaises(ValueError):
            self.model.info


class TestText(unittest.TestCase):
    """The tiny model with a tokenizer made to fit it: text prompts and streamed text pieces."""

    def setUp(self):
        self.model = dayzero.Model(env("DAYZERO_TEST_TEXT_MODEL"))
        self.tok = self.model.tokenizer

    def tearDown(self):
        self.model.close()

    def test_tokenizer(self):
        self.assertIsNotNone(self.tok)
        self.assertEqual(self.tok.vocab_size, 508)
        ids = self.tok.encode("hello there")
        self.assertEqual(ids[0], self.tok.token_id("hello"))
        self.assertEqual(len(ids), 4)  # hello, " t", he, re
        self.assertEqual(self.tok.decode(ids), "hello there")
        self.assertEqual(self.tok.encode("<|end|>", parse_special=True), [504])
        self.assertIsNone(self.tok.token_id("no such token"))
        self.assertIn(500, self.tok.stop_ids)
        chat = self.tok.apply_chat_template([{"role": "user", "content": "hi"}])
        self.assertEqual(chat, "<|start|>user<|message|>hi<|end|><|start|>assistant")
        with self.assertRaises(dayzero.DayzeroError) as cm:
            self.tok.decode([99999])
        self.assertIn("99999", cm.exception.message)

    def test_generate_streams_the_c_api_text(self):
        prompt = self.tok.encode("hello there")
        ids, text = reference(env("DAYZERO_TEST_TEXT_MODEL"), prompt, 12)
        with self.model.session(arena_options=SMALL) as s:
            self.assertEqual(list(s.generate_tokens("hello there", max_tokens=12, stop=())), ids)
        with self.model.session(arena_options=SMALL) as s:
            pieces = list(s.generate("hello there", max_tokens=12, stop=()))
        self.assertTrue(pieces and all(isinstance(p, str) and p for p in pieces))
        self.assertEqual("".join(pieces).encode(), text)
        # With the default stop ids generation ends at the first of them, which is not shown.
        stop = set(self.tok.stop_ids)
        with self.model.session(arena_options=SMALL) as s:
            got = list(s.generate_tokens("hello there", max_tokens=12))
        first_stop = next((i for i, t in enumerate(ids) if t in stop), None)
        self.assertEqual(got, ids if first_stop is None else ids[:first_stop + 1])


class TestReadme(unittest.TestCase):
    def test_readme_example_runs(self):
        with open(os.path.join(PKG_ROOT, "README.md")) as f:
            code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
        self.assertLessEqual(len(code.strip().splitlines()), 12)
        r = subprocess.run([sys.executable, "-c", code], cwd=PKG_ROOT, capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        want = reference_ids()[:4]
        self.assertIn(" ".join(str(t) for t in want), r.stdout)
        self.assertIn("IO", r.stdout)


if __name__ == "__main__":
    unittest.main()

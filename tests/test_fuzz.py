"""Seeded fuzzing of the reader: mutated files either load or raise a RotationZooError, never more.

Mutants come from small valid files (``.pt`` with separate and shared storages, V2 per KV head, V3
with ``k_mean`` / ``q_rotation`` and metadata, ragged V1, safetensors): byte
flips, interesting values, truncation, splices, mutations of ``data.pkl`` at the pickle-opcode
level re-zipped with valid CRCs (so they reach the unpickler), and mutations of the safetensors
JSON header. A larger campaign: ``ROTATIONZOO_FUZZ_MUTANTS=20000 ROTATIONZOO_FUZZ_SEED=7 pytest
tests/test_fuzz.py -s``.
"""

from __future__ import annotations

import collections
import io
import os
import pickletools
import random
import re
import time
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch

from rotationzoo import RotationSet, read_rotation, validate, write_rotation
from rotationzoo.errors import RotationZooError
from rotationzoo.files.validation import verify_file

from helpers import random_orthogonal

N_MUTANTS = int(os.environ.get("ROTATIONZOO_FUZZ_MUTANTS", "2000"))
SEED = int(os.environ.get("ROTATIONZOO_FUZZ_SEED", "0"))
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x30, 0x39, ord("("), ord("."), ord("K"), ord("J"), ord("M")]


def seed_files(tmp: Path) -> dict[str, bytes]:
    """Small valid files: 2 layers of d=16 (the reader takes any d >= 1)."""
    torch.manual_seed(0)
    rs = RotationSet(rotations=random_orthogonal(2, 16), layer_ids=(0, 1), objective="qqt_r_h_pbr",
                     eigenvalues=torch.rand(2, 16))
    shared = RotationSet(rotations=random_orthogonal(1, 16).expand(2, 16, 16).clone(), layer_ids=(3, 7),
                         objective="hadamard")
    g = torch.Generator().manual_seed(1)
    per_head = RotationSet(rotations=random_orthogonal(4, 16).reshape(2, 2, 16, 16), layer_ids=(0, 1),
                           objective="cov_eig_hadamard_perhead")  # V2
    centered = RotationSet(rotations=random_orthogonal(4, 16).reshape(2, 2, 16, 16), layer_ids=(0, 1),
                           objective="oscar2_center", eigenvalues=torch.rand(2, 2, 16, generator=g),
                           k_mean=torch.randn(2, 2, 16, generator=g), calibration={"tokens": 64, "tp_size": 1},
                           transform={"key": "center", "centered": True, "orthogonal": True})  # V3
    r = random_orthogonal(2, 16) * (0.5 + torch.rand(2, 1, 16, generator=g))
    whitened = RotationSet(rotations=r, layer_ids=(0, 1), objective="oscar2_whiten",
                           q_rotation=torch.linalg.inv(r.double()).transpose(-1, -2).float(),
                           transform={"key": "whiten", "orthogonal": False})  # V3, non-orthogonal
    ragged = RotationSet(rotations=(random_orthogonal(1, 8)[0], random_orthogonal(1, 16)[0]), layer_ids=(0, 5),
                         objective="qqt_r_h_pbr", calibration={"prompt_sha256": "ab" * 32})  # ragged V1
    out = {
        "pt": write_rotation(tmp / "k.pt", rs).read_bytes(),
        "pt-shared": write_rotation(tmp / "h.pt", shared).read_bytes(),
        "safetensors": write_rotation(tmp / "k.safetensors", rs).read_bytes(),
        "pt-v2": write_rotation(tmp / "k2.pt", per_head).read_bytes(),
        "pt-v3": write_rotation(tmp / "k3.pt", centered).read_bytes(),
        "pt-v3-inverse": write_rotation(tmp / "k3i.pt", whitened).read_bytes(),
        "pt-ragged": write_rotation(tmp / "kr.pt", ragged).read_bytes(),
        "safetensors-v3": write_rotation(tmp / "k3.safetensors", centered).read_bytes(),
    }
    for name, data in out.items():  # the seeds themselves are valid
        path = tmp / f"seed-{name}"
        path.write_bytes(data)
        validate(read_rotation(path))
    return out


# -- byte-level mutations ------------------------------------------------------------------------


def flip(rng: random.Random, b: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return b


def interesting(rng: random.Random, b: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] = rng.choice(INTERESTING)
    return b


def truncate(rng: random.Random, b: bytearray) -> bytearray:
    return b[: rng.randrange(len(b))]


def splice(rng: random.Random, b: bytearray) -> bytearray:
    i, j = sorted(rng.randrange(len(b)) for _ in range(2))
    k = rng.randrange(len(b))
    chunk = b[i:j][:4096]
    op = rng.randrange(3)
    if op == 0:  # insert a copy elsewhere
        return b[:k] + chunk + b[k:]
    if op == 1:  # delete a span
        return b[:i] + b[j:]
    return b[:k] + chunk + b[k + len(chunk):]  # overwrite


BYTE_MUTATORS: list[Callable[[random.Random, bytearray], bytearray]] = [flip, interesting, truncate, splice]


# -- pickle-level mutations, re-zipped with valid CRCs --------------------------------------------


def mutate_pickle(rng: random.Random, pkl: bytes) -> bytes:
    ops = [(pos, op, arg) for op, arg, pos in pickletools.genops(pkl)]
    bounds = [pos for pos, _, _ in ops] + [len(pkl)]
    spans = [(bounds[i], bounds[i + 1]) for i in range(len(ops))]
    kind = rng.randrange(6)
    if kind == 0:  # delete an opcode
        s, e = rng.choice(spans)
        return pkl[:s] + pkl[e:]
    if kind == 1:  # duplicate an opcode
        s, e = rng.choice(spans)
        return pkl[:e] + pkl[s:e] + pkl[e:]
    if kind == 2:  # move an opcode
        s, e = rng.choice(spans)
        rest = pkl[:s] + pkl[e:]
        k = rng.choice([a for a, _ in spans if a <= len(rest)])
        return rest[:k] + pkl[s:e] + rest[k:]
    if kind == 3:  # change an integer argument (sizes, strides, offsets, numels, layer keys)
        cands = [(pos, op, arg) for pos, op, arg in ops if op.name in ("BININT1", "BININT2", "BININT")]
        pos, op, _ = rng.choice(cands)
        if op.name == "BININT":
            val = rng.choice([0, 1, -1, 2**31 - 1, -(2**31), 16384, 65536, rng.randrange(-(2**31), 2**31)])
            arg = val.to_bytes(4, "little", signed=True)
        else:
            width = 1 if op.name == "BININT1" else 2
            arg = rng.randrange(256**width).to_bytes(width, "little")
        return pkl[: pos + 1] + arg + pkl[pos + 1 + len(arg):]
    if kind == 4:  # replace a string argument (keys, storage keys, dtypes, globals)
        cands = [(pos, op, arg) for pos, op, arg in ops if op.name in ("BINUNICODE", "GLOBAL")]
        pos, op, arg = rng.choice(cands)
        new = rng.choice(["0", "1", "inf", "layers", "rotation", "-1", "٣", "torch DoubleStorage",
                          "torch._utils _rebuild_sparse_tensor", "os system", "builtins eval", "x" * 300])
        if op.name == "GLOBAL":
            enc = (new if " " in new else "torch " + new).replace(" ", "\n", 1).encode() + b"\n"
            end = pkl.index(b"\n", pkl.index(b"\n", pos) + 1) + 1
            return pkl[: pos + 1] + enc + pkl[end:]
        raw = new.encode()
        old_len = int.from_bytes(pkl[pos + 1: pos + 5], "little")
        return pkl[: pos + 1] + len(raw).to_bytes(4, "little") + raw + pkl[pos + 5 + old_len:]
    return bytes(flip(rng, bytearray(pkl)))


def rezip(data: bytes, new_pkl: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = new_pkl if info.filename.endswith("/data.pkl") else src.read(info.filename)
            dst.writestr(info.filename, body)
    return out.getvalue()


def pickle_mutant(rng: random.Random, data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    for _ in range(rng.randint(1, 3)):
        try:
            pkl = mutate_pickle(rng, pkl)
        except (ValueError, IndexError):  # genops stops at an earlier mutation; mutate the bytes
            pkl = bytes(flip(rng, bytearray(pkl)))
    return rezip(data, pkl)


def header_mutant(rng: random.Random, data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = data[8: 8 + n].decode()
    numbers = list(re.finditer(r"\d+", header))
    for _ in range(rng.randint(1, 3)):
        m = rng.choice(numbers)
        val = str(rng.choice([0, 1, 15, 16, 17, 2**31, 2**63, 10**30, rng.randrange(10**6)]))
        header = header[: m.start()] + val + header[m.end():]
        numbers = list(re.finditer(r"\d+", header))
    raw = header.encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


# -- the campaign --------------------------------------------------------------------------------


def run_campaign(tmp: Path, n: int, seed: int) -> tuple[collections.Counter, list[str]]:
    rng = random.Random(seed)
    seeds = seed_files(tmp)
    counts: collections.Counter = collections.Counter()
    raw: list[str] = []
    for i in range(n):
        kind = rng.choice(list(seeds))
        data = seeds[kind]
        if kind.startswith("pt") and rng.random() < 0.4:
            how, mutant = "pickle", pickle_mutant(rng, data)
        elif kind.startswith("safetensors") and rng.random() < 0.3:
            how, mutant = "header", header_mutant(rng, data)
        else:
            mutator = rng.choice(BYTE_MUTATORS)
            how, mutant = mutator.__name__, bytes(mutator(rng, bytearray(data)))
        path = tmp / f"m{i % 4}.{'safetensors' if kind.startswith('safetensors') else 'pt'}"
        path.write_bytes(mutant)
        try:
            rs = read_rotation(path)
            validate(rs, raise_on_error=False)
            counts["loaded"] += 1
        except RotationZooError as exc:
            counts[type(exc).__name__] += 1
        except BaseException as exc:  # noqa: BLE001 - the point of the test
            counts["RAW " + type(exc).__name__] += 1
            raw.append(f"mutant {i} ({kind}, {how}): {type(exc).__name__}: {str(exc)[:200]}")
        if i % 10 == 0:
            try:
                report = verify_file(path)  # documented never to raise
                assert report.ok or report.problems
            except BaseException as exc:  # noqa: BLE001
                counts["RAW from verify_file " + type(exc).__name__] += 1
                raw.append(f"verify_file, mutant {i} ({kind}, {how}): {type(exc).__name__}: {str(exc)[:200]}")
    return counts, raw


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pickletools decoding mutated text opcodes
@pytest.mark.filterwarnings("ignore::rotationzoo.files.format.RotationFormatWarning")  # mutated labels
def test_fuzz_reader_raises_only_typed_errors(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    counts, raw = run_campaign(tmp_path, N_MUTANTS, SEED)
    elapsed = time.perf_counter() - t0
    print(f"\nfuzz seed {SEED}: {N_MUTANTS} mutants in {elapsed:.1f} s: {dict(counts.most_common())}")
    assert not raw, "\n".join(raw[:20])
    assert sum(v for k, v in counts.items() if not k.startswith("RAW from verify_file")) == N_MUTANTS
    assert counts["loaded"] > 0 and counts["RotationFileError"] > 0  # the mutants exercise both paths


# -- pair-file metadata ----------------------------------------------------------------------------

N_META_MUTANTS = int(os.environ.get("ROTATIONZOO_FUZZ_META_MUTANTS", "300"))
META_KEYS = ["format", "export_format_version", "sides", "head_dim", "layer_ids", "model", "tag", "rotationzoo_version",
             "k.objective", "k.format_version", "k.source_grouping", "k.sha256", "v.objective", "v.format_version",
             "v.source_grouping", "v.sha256", "group_size", "x.unknown"]


def hostile_text(rng: random.Random) -> str:
    pool = ["", "1", "0", "-1", "²", "١٢", "1.0", "1e3", "nan", "inf", str(2**70), "9" * 400, " 1", "1\n", "0x10",
            "k", "k,v", "v,k", "0,1", "0,1,2,3", "0,,1", "16", "kv_head", "layer", "identity-v1", "a/b", "../x",
            "/etc; rm -rf ~", "$(id)", "\x1b[31mred", "\0", "a" * 2000, "0" * 64, "f" * 63 + "g"]
    if rng.random() < 0.3:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
                       for _ in range(rng.randrange(0, 40)))
    return rng.choice(pool)


def test_fuzz_pair_file_metadata_raises_only_typed_errors(tmp_path: Path) -> None:
    """Pair files (safetensors and GGUF) with hostile metadata: read, validated and verified with
    typed errors only."""
    import numpy as np
    from safetensors.torch import save_file

    from rotationzoo.files.pair import read_pair, verify_path

    gguf = pytest.importorskip("gguf")
    T = gguf.GGUFValueType
    rng = random.Random(SEED)
    rots = {s: random_orthogonal(2, 8, i) for i, s in enumerate("kv")}
    tensors = {f"{s}.{i}.rotation": rots[s][i] for s in "kv" for i in range(2)}
    base = {"format": "rotationzoo.rotations", "export_format_version": "1", "sides": "k,v", "head_dim": "8",
            "layer_ids": "0,1", "k.objective": "qqt_r_h_pbr", "v.objective": "sst_r_h_pbr", "k.format_version": "1",
            "v.format_version": "1"}
    counts: collections.Counter = collections.Counter()
    raw: list[str] = []
    for i in range(N_META_MUTANTS):
        meta = dict(base)
        for _ in range(rng.randint(1, 3)):
            meta[rng.choice(META_KEYS)] = hostile_text(rng)
        if i % 2 == 0:
            path = tmp_path / "m.safetensors"
            save_file(tensors, str(path), metadata=meta)
        else:
            path = tmp_path / "m.gguf"
            w = gguf.GGUFWriter(str(path), "rotationzoo")
            for key, value in meta.items():
                kind = rng.randrange(5)
                if kind == 0 and value.isascii() and value.isdigit() and int(value) < 2**32:
                    w.add_key_value("rotationzoo." + key, int(value), T.UINT32)
                elif kind == 1:
                    w.add_key_value("rotationzoo." + key, rng.choice([1.0, -1.5, float("nan")]), T.FLOAT32)
                elif kind == 2:
                    w.add_key_value("rotationzoo." + key, rng.choice([True, False]), T.BOOL)
                elif kind == 3:
                    w.add_key_value("rotationzoo." + key, [rng.randrange(-5, 5) for _ in range(rng.randrange(1, 5))],
                                    T.ARRAY, sub_type=T.INT32)
                else:
                    w.add_key_value("rotationzoo." + key, value, T.STRING)
            for s in "kv":
                for layer in range(2):
                    w.add_tensor(f"blk.{layer}.attn_{s}_rot.weight", np.ascontiguousarray(rots[s][layer].numpy().T))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        try:
            pair = read_pair(path)
            pair.validate()
            _ = (pair.model, pair.tag, pair.fitted_group_size, pair.recorded_config)
            counts["loaded"] += 1
        except RotationZooError as exc:
            counts[type(exc).__name__] += 1
        except BaseException as exc:  # noqa: BLE001 - the point of the test
            counts["RAW " + type(exc).__name__] += 1
            raw.append(f"mutant {i} ({path.suffix}, {meta}): {type(exc).__name__}: {str(exc)[:200]}")
        try:
            reports = verify_path(path)  # documented never to raise
            assert all(r.ok or r.problems for r in reports)
        except BaseException as exc:  # noqa: BLE001
            raw.append(f"verify_path, mutant {i} ({path.suffix}): {type(exc).__name__}: {str(exc)[:200]}")
    print(f"\npair-file metadata fuzz seed {SEED}: {N_META_MUTANTS} mutants: {dict(counts.most_common())}")
    assert not raw, "\n".join(raw[:20])
    assert counts["loaded"] > 0 and counts["ExportError"] > 0 and counts["UnsupportedFormatError"] > 0

"""Serving and export commands: ``serve-args``, ``export``.

Examples::

    rotationzoo serve-args Qwen3-30B-A3B
    rotationzoo serve-args Qwen3-30B-A3B --tp 4
    rotationzoo serve-args Qwen3-8B --engine sglang-legacy
    rotationzoo serve-args Qwen3-8B --calibrate
    rotationzoo serve-args Qwen3-8B --engine vllm --format env > oscar.env
    rotationzoo serve-args GLM-5.2                   # an MLA latent set: SGLANG_OSCAR_MLA_KV_ROTATION_PATH ...
    rotationzoo serve-args Qwen3-8B --engine llamacpp --model-path qwen3-8b-q4_k_m.gguf --json
    rotationzoo export Qwen3-8B --to safetensors --out qwen3-8b-oscar.safetensors
    rotationzoo export Qwen3-8B --to gguf --out qwen3-8b-rot.gguf
    rotationzoo export qwen3-8b-rot.gguf --to gguf --base-gguf qwen3-8b-q4_k_m.gguf --out qwen3-8b-q4_k_m-rot-kv.gguf
    rotationzoo export ./rotations/ --to safetensors --out pair.safetensors --json
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import vocab
from ..errors import CLIError
from ._options import (
    CacheDirOpt,
    JsonOpt,
    OfflineOpt,
    RevisionOpt,
    RotationsHelp,
    SideOpt,
    SourceOpt,
    TagOpt,
    TimeoutOpt,
    choice,
    usage_errors,
)
from ._output import console, emit_json, json_requested, print_warning, printable


def _format_callback(value: str) -> str:
    json_requested(value == "json")
    return value


def cmd_serve_args(
    model: Annotated[str, typer.Argument(metavar="ROTATIONS", help=f"What to serve: {RotationsHelp}.")],
    engine: Annotated[str, typer.Option("--engine", "-e", help="sglang (the authors' current SGLang tree, the "
                                        "default) | sglang-legacy (their May 2026 fork) | vllm (the port of vLLM "
                                        "pull request 46774) | vllm-prototype (a vLLM OSCAR prototype tree) | "
                                        "llamacpp (the authors' branch); llama.cpp / llama-cpp work too.")] = "sglang",
    tag: TagOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", click_type=choice(vocab.LAUNCH_FORMATS),
                                     callback=_format_callback,
                                     help="shell (copy-pasteable command) | env (KEY=VALUE lines) | json "
                                          "(the same as --json).")] = "shell",
    model_path: Annotated[Optional[str], typer.Option("--model-path", help="What the engine loads instead of the registry "
                          "id: a checkpoint folder (sglang, vllm) or the model's GGUF file (llamacpp).")] = None,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    tp_size: Annotated[Optional[int], typer.Option("--tp-size", "--tp", metavar="N", help="Tensor-parallel ranks "
                       "(default: the entry's recipe); prints the KV heads each rank holds, or why the heads cannot "
                       "be split over N ranks.")] = None,
    ep_size: Annotated[Optional[int], typer.Option("--ep-size", "--ep", metavar="N", help="Expert parallelism for "
                       "MoE layers (default: the entry's recipe, 1: none): sglang splits the TP ranks into N expert "
                       "groups (N divides the TP size), vllm spreads the experts over every TP rank "
                       "(--enable-expert-parallel, N = the TP size). Each expert's weights are then split over "
                       "TP / N ranks; the KV heads stay split over all TP ranks.")] = None,
    absorb_v_rotation: Annotated[Optional[bool], typer.Option(
        "--absorb-v-rotation/--no-absorb-v-rotation", help="Fold R_V into the weights at load time, or not "
        "(default: the entry's; refused for per-KV-head, centered or non-orthogonal rotations).")] = None,
    disable_radix_cache: Annotated[bool, typer.Option("--disable-radix-cache", help="Serve without the prefix cache "
                                   "(SGLang targets; on by default in the current tree).")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Print the start-up calibration settings instead of "
                         "rotation paths: the authors' current tree fits a pair when it starts (a registry model; "
                         "nothing is downloaded).")] = False,
    block_size: Annotated[Optional[int], typer.Option("--block-size", metavar="TOKENS", help="vLLM targets: "
                          "the KV block size to launch with (vLLM's own flag), 1 to 65,536 tokens; the port keeps "
                          "whole blocks of the sink, so a sink shorter than one block is refused.")] = None,
    k_clip_per_layer: Annotated[Optional[str], typer.Option("--k-clip-per-layer", metavar="FILE|R,R,...", help="sglang: "
                                "a per-layer K clip table (JSON {layer: ratio} or list in global layer order, or a "
                                "comma list), checked against the rotations' layers.")] = None,
    k_clip_per_head: Annotated[Optional[str], typer.Option("--k-clip-per-head", metavar="FILE", help="sglang: a "
                               "per-head K clip table (JSON {\"<layer>,<head>\": ratio}), checked against the layers "
                               "and KV heads.")] = None,
    cache_dir: CacheDirOpt = None,
    offline: OfflineOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Print the launch settings that serve these rotations with an OSCAR-enabled engine.

    Resolves the rotations (a registry entry is fetched and verified if not cached), checks that the
    engine reads what the files hold (one line says why not), and prints environment variables
    (local rotation paths, the entry's clip ratios, windows, group size, dtypes, absorption) and the
    engine's command line (TP size, backends, prefix cache from the entry's recipe). On stderr: caveats,
    the KV heads of each tensor-parallel rank, and the server log lines to check. For llamacpp it also
    writes a rotations GGUF into the cache's derived area (see `rotationzoo cache ls`) and prints the
    step that appends it to the model GGUF; for the other engines a pair held in one file
    (pair.safetensors, a rotations GGUF) is written there as K and V .pt files, which the launch names.
    A model whose rotations are an MLA latent set (GLM-5.2, Kimi-K3, ...) is served from its checked
    folder of layer_<id>.pt files (fetched, or imported with `rotationzoo cache import FOLDER --latent MODEL`).

    Examples:  rotationzoo serve-args Qwen3-30B-A3B  |  rotationzoo serve-args Qwen3-30B-A3B --tp 4  |
    rotationzoo serve-args MiniMax-M2.7 --tp 8 --ep 2  |
    rotationzoo serve-args Qwen3-8B -e sglang-legacy  |  rotationzoo serve-args Qwen3-8B --calibrate  |
    rotationzoo serve-args Qwen3-8B -e vllm --format env  |  rotationzoo serve-args Qwen3-8B -e vllm --block-size 64  |
    rotationzoo serve-args GLM-5.2 --json  |  rotationzoo serve-args Qwen3-8B --k-clip-per-layer clip.json  |
    rotationzoo serve-args Qwen3-4B-Thinking -e llamacpp --model-path qwen3-4b-q4_k_m.gguf --json
    """
    import warnings

    from ..numbers import check_int
    from ..serving import MAX_BLOCK_TOKENS, launch_spec

    if block_size is not None:
        with usage_errors():  # launch_spec's own bound, named as the option
            check_int(block_size, "--block-size", low=1, high=MAX_BLOCK_TOKENS, hint=" tokens")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = launch_spec(model, tag, engine=engine, model_path=model_path, source=source, revision=revision,
                           cache_dir=cache_dir, offline=offline, timeout=timeout, tp_size=tp_size,
                           ep_size=ep_size, absorb_v_rotation=absorb_v_rotation, disable_radix_cache=disable_radix_cache or None,
                           calibrate=calibrate, block_size=block_size, k_clip_per_layer=k_clip_per_layer,
                           k_clip_per_head=k_clip_per_head)
    for w in caught:  # an unpinned file pinned on first use: one line, as `fetch` says it
        print_warning(str(w.message))
    if json_out or fmt == "json":
        emit_json(spec.to_json())
        return
    typer.echo(spec.render(fmt))
    from rich.text import Text

    err = console(stderr=True)
    for note in spec.notes:
        if note.startswith("replace ") or "replace MODEL" in note:
            print_warning(note)
        else:
            err.print(Text(f"note: {printable(note, drop_ansi=True)}", style="dim"))  # a note may quote file metadata
    for check in spec.checks:
        err.print(Text(f"check: {printable(check, drop_ansi=True)}"))


def cmd_export(
    rotations: Annotated[str, typer.Argument(metavar="ROTATIONS", help=f"What to export: {RotationsHelp}, or one rotation file.")],
    to: Annotated[str, typer.Option("--to", click_type=choice(vocab.EXPORT_FORMATS), help="safetensors | gguf.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output file (an existing one is replaced, whole: written "
                                      "beside it, then renamed; a link there is replaced, not written through).")],
    tag: TagOpt = None,
    side: SideOpt = None,
    base_gguf: Annotated[Optional[Path], typer.Option("--base-gguf", help="GGUF only: a model GGUF to copy through with "
                         "the rotation tensors appended (what the llama.cpp branch loads).")] = None,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    cache_dir: CacheDirOpt = None,
    offline: OfflineOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Export K/V rotations to one safetensors file, or to GGUF for the llama.cpp branch.

    safetensors: tensors k.<layer>.rotation, v.<layer>.rotation (fp32 [d, d], or [H_kv, d, d] per KV
    head), their eigenvalues when the source has them, and the companions a pair carries
    (k.<layer>.k_mean, k.<layer>.q_rotation, v.<layer>.o_rotation, v.<layer>.v_mean; docs/export.md);
    metadata with model, tag, objective and format_version per side. GGUF: tensors
    blk.<layer>.attn_k_rot.weight / attn_v_rot.weight holding the transposed matrices (F32), so that
    ggml_mul_mat(rot, K) == K @ M; with --base-gguf they are appended to a copy of a model GGUF.
    `rotationzoo verify` reads both back.

    Examples:  rotationzoo export Qwen3-8B --to gguf --out qwen3-8b-rot.gguf  |
    rotationzoo export ./rotations --to safetensors --out pair.safetensors  |
    rotationzoo export qwen3-8b-rot.gguf --to gguf --base-gguf model.gguf --out model-rot-kv.gguf
    """
    from ..export import export, read_exported

    if base_gguf is not None and to != "gguf":
        raise CLIError("--base-gguf applies to --to gguf only")
    path = export(rotations, out, to=to, tag=tag, side=side, base_gguf=base_gguf, source=source, revision=revision,
                  cache_dir=cache_dir, offline=offline, timeout=timeout)
    got = read_exported(path)
    info: dict[str, Any] = {
        "out": str(path), "to": to, "model": got.model, "tag": got.tag, "sides": list(got.sides),
        "layers": len(got.layer_ids), "head_dim": got.head_dims.to_json(), "objectives": got.objectives,
        "bytes": path.stat().st_size, "base_gguf": str(base_gguf) if base_gguf else None,
    }
    if json_out:
        emit_json(info)
        return
    what = f"{info['model']}@{info['tag']}" if info["model"] else rotations  # the file's metadata: literally
    console().print(printable(f"wrote {path} ({to}, {info['bytes']:,} bytes): {what}, sides "
                              f"{'+'.join(info['sides']).upper()}, {info['layers']} layers × d={got.head_dims}"),
                    markup=False)


def register(app: typer.Typer) -> None:
    app.command("serve-args")(cmd_serve_args)
    app.command("export")(cmd_export)

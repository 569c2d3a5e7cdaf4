import pytest

from criticalkv.hf import loading


def test_missing_model_paths_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        loading.resolve_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loading.resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert loading.resolve_model(tmp_path) == tmp_path


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CRITICALKV_CACHE", str(tmp_path / "c"))
    assert loading.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CRITICALKV_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert loading.cache_dir() == tmp_path / "x" / "criticalkv"


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="gpt2"):
        loading.check_supported(GPT2Config())


def test_a_conversion_removes_what_killed_conversions_left_and_says_so(monkeypatch, tmp_path, capsys):
    import os
    import subprocess
    import sys

    from criticalkv.files import sha256_file

    monkeypatch.setenv("CRITICALKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    models = tmp_path / "cache" / "models"
    target = models / f"m-{sha256_file(gguf)[:16]}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # already converted: only the leftovers are dealt with
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [models / f".converting-{dead.pid}-ab12", models / ".converting-cd34ef56"]
    live = models / f".converting-{os.getppid()}-gh78"
    for path in [*stale, live]:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"0" * 100)
    assert loading.convert_gguf(gguf) == target
    err = capsys.readouterr().err
    assert all(not path.exists() and f"removed {path}: a temporary left by" in err for path in stale)
    assert live.exists() and sorted(p.name for p in models.iterdir()) == sorted([target.name, live.name])


@pytest.mark.parametrize("size", [0, 1_000_000])  # a file that is not GGUF; one cut inside its metadata
def test_a_corrupt_gguf_is_named(monkeypatch, tmp_path, size):
    monkeypatch.setenv("CRITICALKV_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "cut.gguf"
    if size:
        with open(loading.bundled_gguf(), "rb") as f:
            bad.write_bytes(f.read(size))
    else:
        bad.write_bytes(b"not a GGUF file at all")
    with pytest.raises(ValueError, match=f"{bad}: cannot read this GGUF file .*truncated or corrupt"):
        loading.convert_gguf(bad, progress=False)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == []

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

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


def test_one_cache_root_for_the_converted_models_and_the_server_wheel(monkeypatch, tmp_path):
    from criticalkv.serving import launcher

    for env in ({"CRITICALKV_CACHE": str(tmp_path / "c")}, {"XDG_CACHE_HOME": str(tmp_path / "x")}, {}):
        for name in ("CRITICALKV_CACHE", "XDG_CACHE_HOME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert launcher.cache_dir() == loading.cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert launcher.cache_dir() == tmp_path / "x" / "criticalkv"


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


#: (model_type, words of its refusal that name the family's own difference)
REFUSED = [
    ("phi3", "qkv_proj"), ("phi", "LayerNorm"), ("gemma", "(1 + weight) RMSNorm"), ("gemma2", "soft-capping"),
    ("gemma3_text", "q/k norms"), ("mixtral", "mixture of experts"), ("qwen2_moe", "mixture of experts"),
    ("qwen3_moe", "dense Qwen3"), ("smollm3", "no_rope_layers"), ("granite", "multipliers"),
    ("olmo2", "post-norm"), ("gpt2", "separate q/k/v/o projections"),
]


@pytest.mark.parametrize("model_type, reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_other_families_are_refused_with_their_reason(model_type, reason):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported") as err:
        loading.check_supported(AutoConfig.for_model(model_type))
    assert reason in str(err.value) and "qwen3" in str(err.value)  # the reason, then what is supported


@pytest.mark.parametrize("model_type", ["llama", "mistral", "ministral", "qwen2", "qwen3"])
def test_llama_family_types_pass(model_type):
    from transformers import AutoConfig

    loading.check_supported(AutoConfig.for_model(model_type))


def test_refused_models_fail_before_any_work(tmp_path):
    """A refused family fails on the PyTorch path and at export with the family's reason; an engine build stops
    from the config alone (the folder holds no weights: loading them would fail otherwise)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from criticalkv import KVPolicy
    from criticalkv.build import build_engine
    from criticalkv.export import BuildConfig
    from criticalkv.export.decoder import model_spec
    from criticalkv.hf import prefill_and_compress

    config = AutoConfig.for_model("phi3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)
    phi3 = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="fuse q/k/v into one qkv_proj"):
        prefill_and_compress(phi3, torch.ones(1, 20, dtype=torch.int64), KVPolicy("snapkv", budget=8, window=4))
    with pytest.raises(ValueError, match="fuse q/k/v into one qkv_proj"):
        model_spec(phi3)
    config.save_pretrained(tmp_path / "phi3")
    with pytest.raises(ValueError, match="fuse q/k/v into one qkv_proj"):
        build_engine(tmp_path / "engine", KVPolicy("snapkv", budget=32), BuildConfig(max_input_len=64),
                     model=str(tmp_path / "phi3"), log=lambda msg: None)
    assert not (tmp_path / "engine").exists()

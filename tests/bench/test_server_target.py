"""The server under test on the command line (``criticalkv.bench.served``): ``--url`` with or without a model, the
checks of ``--engine-dir`` / ``--url`` / ``--server-args`` together, and where a running server's tokenizer comes
from. No server: the cases that need none."""

import argparse

import pytest

from criticalkv.bench import served


def args_of(*argv: str, several: bool = True) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    served.add_server_arguments(p, several=several)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("text, expected", [
    ("http://127.0.0.1:8000", ("http://127.0.0.1:8000", None)),
    ("http://127.0.0.1:8000/", ("http://127.0.0.1:8000", None)),
    ("http://10.0.0.2:9000/v2/models/ckv", ("http://10.0.0.2:9000", "ckv")),
    ("http://10.0.0.2:9000/v2/models/ckv/", ("http://10.0.0.2:9000", "ckv")),
])
def test_url_names_the_server_and_optionally_its_model(text, expected):
    assert served.running_server(text) == expected


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        served.running_server("127.0.0.1:8000")


def test_engine_dirs_and_urls_are_checked_together(tmp_path):
    with pytest.raises(ValueError, match="give --engine-dir .* or --url"):
        served.check_server_arguments(args_of())
    with pytest.raises(ValueError, match="only for servers started here"):
        served.check_server_arguments(args_of("--url", "http://127.0.0.1:8000", "--server-args", "--threads 1"))
    with pytest.raises(ValueError, match="at most one --engine-dir"):
        served.check_server_arguments(args_of("--url", "http://127.0.0.1:8000", "--engine-dir", "a", "--engine-dir", "b"))
    with pytest.raises(FileNotFoundError, match="not an engine directory"):
        served.check_server_arguments(args_of("--engine-dir", str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="not an engine directory"):
        served.check_server_arguments(args_of("--engine-dir", str(tmp_path), several=False))


def test_the_tokenizer_is_the_engine_dirs_even_with_a_url(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    args = args_of("--url", "http://127.0.0.1:9", "--engine-dir", str(tmp_path))
    assert served.tokenizer_folder(args) == tmp_path / "tokenizer"
    (tmp_path / "tokenizer").rmdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer folder here"):
        served.tokenizer_folder(args)


def test_kv_memory_is_a_count_or_mib():
    assert served.kv_memory("4") == (None, 4.0)
    assert served.kv_memory("2.5") == (None, 2.5)
    assert served.kv_memory("300MiB") == (300.0, None) and served.kv_memory("12.5 mib") == (12.5, None)
    for bad in ("0", "-1MiB", "lots", "nanMiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            served.kv_memory(bad)
    p = argparse.ArgumentParser()
    served.add_kv_memory_argument(p, "4", "documents")
    assert p.parse_args([]).kv_memory == (None, 4.0) and p.parse_args(["--kv-memory", "64MiB"]).kv_memory == (64.0, None)

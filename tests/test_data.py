"""Public traces: the registry, verified local copies and downloads, the loader,
and the one-line errors of ``sweep-grid`` and ``sweep-data``. No test reaches
the network: downloads go to a server on 127.0.0.1, or to a closed port."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO, SHARED_DATA, script

from sweep.config.schema import (
    ArrivalKind,
    ConfigError,
    LengthDist,
    LengthKind,
    Trace,
    Workload,
)
from sweep.data import REGISTRY, DataError, PublicTrace, fetch, status
from sweep.latency.workload import load_trace, resolve_trace_path, workload_tables

CONV = "azure_llm_2023_conv.csv"
# a proxy on a closed local port: any download fails at once, online or not
OFFLINE = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": ""}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def readme_table(path: Path) -> dict[str, tuple[int, str]]:
    """``file -> (bytes, sha256)`` from a data README's markdown table."""
    rows = re.findall(r"^\| (\S+\.csv) \| ([\d,]+) \| \S+ \| ([0-9a-f]{64}) \|$",
                      path.read_text(), flags=re.M)
    return {name: (int(size.replace(",", "")), digest) for name, size, digest in rows}


# the loader against tiny traces written here -------------------------------

def tiny_workload(path: Path, **trace) -> Workload:
    return Workload(name="tiny", trace=Trace(path=str(path), **trace),
                    prompt=LengthDist(kind=LengthKind.trace),
                    output=LengthDist(kind=LengthKind.trace), arrival=ArrivalKind.trace)


def test_loader_reads_a_tiny_csv_trace(tmp_path):
    f = tmp_path / "tiny.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:00:00.0000000,100,10\n"
                 "2023-11-16 18:00:00.2500000,300,0\n"
                 "2023-11-16 18:00:01.5000000,100,30\n"
                 "2023-11-16 18:00:01.5000000,200,10\n")
    w = tiny_workload(f, timestamp_column="TIMESTAMP", timestamp_unit="datetime",
                      prompt_column="ContextTokens", output_column="GeneratedTokens")
    data = load_trace(w.trace)
    np.testing.assert_allclose(data.arrival_s, [0.0, 0.25, 1.5, 1.5], atol=1e-9)
    t = workload_tables(w)
    # prompts 100, 300, 100, 200; the failed request's 0 output is not served
    np.testing.assert_array_equal(t.prompt_values, [100, 200, 300])
    np.testing.assert_allclose(t.prompt_probs, [0.5, 0.25, 0.25])
    np.testing.assert_array_equal(t.output_values, [10, 30])
    np.testing.assert_allclose(t.output_probs, [2 / 3, 1 / 3])
    assert t.mean_prompt_tokens == pytest.approx(175.0)
    assert t.mean_output_tokens == pytest.approx(50 / 3)


def test_loader_reads_a_tiny_jsonl_trace(tmp_path):
    f = tmp_path / "tiny.jsonl"
    f.write_text('{"t": 1000, "p": 5, "o": 7}\n{"t": 1500, "p": 9, "o": 7}\n')
    w = tiny_workload(f, format="jsonl", timestamp_column="t", timestamp_unit="ms",
                      prompt_column="p", output_column="o")
    np.testing.assert_allclose(load_trace(w.trace).arrival_s, [0.0, 0.5])
    t = workload_tables(w)
    np.testing.assert_array_equal(t.prompt_values, [5, 9])
    np.testing.assert_array_equal(t.output_values, [7])


def test_an_existing_file_is_used_as_is_even_with_a_registered_name(tmp_path):
    user = tmp_path / CONV
    user.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")  # not verified
    assert resolve_trace_path(str(user)) == user


# the registry --------------------------------------------------------------

def test_workload_configs_name_only_registered_traces():
    bare = set()
    for f in sorted((REPO / "conf" / "workload").glob("*.yaml")):
        path = (yaml.safe_load(f.read_text()).get("trace") or {}).get("path")
        if path and "/" not in path:
            bare.add(path)
    assert bare == set(REGISTRY)


def test_registry_agrees_with_the_data_readmes():
    ours = readme_table(REPO / "sweep" / "data" / "README.md")
    for name, t in REGISTRY.items():
        assert ours[name] == (t.size_bytes, t.sha256), name
        assert t.url == (f"https://raw.githubusercontent.com/{t.repository}/"
                         f"{t.commit}/{t.path}")
    if SHARED_DATA is not None:
        shared = readme_table(SHARED_DATA / "README.md")
        for name, t in REGISTRY.items():
            assert shared[name] == (t.size_bytes, t.sha256), name


@pytest.mark.skipif(SHARED_DATA is None, reason="no shared/data beside the checkout")
def test_registry_hashes_match_the_shared_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEP_DATA_CACHE", str(tmp_path / "cache"))
    for name, t in REGISTRY.items():
        copy = SHARED_DATA / name
        assert copy.stat().st_size == t.size_bytes, name
        assert sha256(copy) == t.sha256, name
        assert fetch(name, SHARED_DATA) == copy
        assert status(name, SHARED_DATA) == ("local", copy)
    assert not (tmp_path / "cache").exists(), "a local copy needs no cache"


def test_corrupted_local_copy_is_refused_with_one_line(tmp_path, monkeypatch):
    empty, bad = tmp_path / "empty", tmp_path / "bad"
    empty.mkdir()
    bad.mkdir()
    (bad / CONV).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                            "2023-11-16 18:15:46.6800000,1000,100\n")
    monkeypatch.setenv("SWEEP_DATA_DIR", str(empty))
    monkeypatch.setenv("SWEEP_DATA_CACHE", str(tmp_path / "cache"))
    # the config's data_dir comes before SWEEP_DATA_DIR
    with pytest.raises(DataError) as e:
        fetch(CONV, bad)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert f"the copy {bad / CONV} has sha256 {sha256(bad / CONV)}" in msg
    assert f"not the registered {REGISTRY[CONV].sha256}" in msg
    assert status(CONV, bad) == ("local, sha256 differs", bad / CONV)
    with pytest.raises(ConfigError, match=r"^workload.trace.path = 'azure_llm_2023_"
                       r"conv.csv': the copy .* has sha256"):
        resolve_trace_path(CONV, str(bad))


def test_data_dir_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^data_dir = '.*nope': not a folder$"):
        fetch(CONV, tmp_path / "nope")


def test_unknown_bare_name_lists_the_registry():
    with pytest.raises(ConfigError, match=r"no such file, nor a registered public "
                       r"trace \(azure_llm_2023_code.csv, "):
        resolve_trace_path("no_such_trace.csv")


# downloads, from a server on 127.0.0.1 standing in for the origin ----------

@dataclass(frozen=True)
class ServedTrace(PublicTrace):
    base_url: str = ""

    @property
    def url(self) -> str:
        return f"{self.base_url}/{self.path}"


@pytest.fixture
def origin(tmp_path):
    """A folder served over HTTP on 127.0.0.1; yields ``(folder, base_url)``."""
    root = tmp_path / "origin"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_download_is_verified_and_cached(origin, tmp_path, monkeypatch, capsys):
    root, base = origin
    body = b"ts,prompt,output\n0,10,1\n1,20,2\n"
    (root / "upstream_name.csv").write_bytes(body)
    good = ServedTrace("tiny.csv", "someone/data", "upstream_name.csv", "0" * 40,
                       hashlib.sha256(body).hexdigest(), len(body), "CC-BY-4.0",
                       "someone", base_url=base)
    wrong = ServedTrace("wrong.csv", "someone/data", "upstream_name.csv", "0" * 40,
                        "f" * 64, len(body), "CC-BY-4.0", "someone", base_url=base)
    monkeypatch.setitem(REGISTRY, "tiny.csv", good)
    monkeypatch.setitem(REGISTRY, "wrong.csv", wrong)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SWEEP_DATA_CACHE", str(cache))
    monkeypatch.delenv("SWEEP_DATA_DIR", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert status("tiny.csv") == ("not fetched", None)
    path = fetch("tiny.csv")
    assert path == cache / "tiny.csv" and path.read_bytes() == body
    assert "fetched tiny.csv (CC-BY-4.0) from someone/data@0000000000" in (
        capsys.readouterr().err)
    assert status("tiny.csv") == ("cached", path)
    (root / "upstream_name.csv").unlink()  # the origin is gone: the cache serves
    assert fetch("tiny.csv") == path
    assert "fetched" not in capsys.readouterr().err
    (root / "upstream_name.csv").write_bytes(body)
    with pytest.raises(DataError, match="the downloaded bytes do not have the "
                       "registered sha256"):
        fetch("wrong.csv")
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.csv"]


# the console scripts --------------------------------------------------------

@pytest.mark.slow
def test_offline_trace_error_through_sweep_grid(tmp_path):
    empty, cache, cwd = tmp_path / "empty", tmp_path / "cache", tmp_path / "run"
    for d in (empty, cwd):
        d.mkdir()
    env = {**os.environ, **OFFLINE, "SWEEP_DATA_DIR": str(empty),
           "SWEEP_DATA_CACHE": str(cache)}
    proc = subprocess.run(
        [script("sweep-grid"), "workload=azure_conv_2023", "hardware=h100_sxm",
         "model=qwen3_8b", "grid=small"], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("sweep-grid: error: workload.trace.path = "
                           "'azure_llm_2023_conv.csv': no copy in the data folder ")
    assert REGISTRY[CONV].url in line
    assert "failed (no connection to raw.githubusercontent.com)" in line
    assert "SWEEP_DATA_DIR or data_dir=" in line and "sweep-data fetch" in line
    assert not any(cwd.iterdir()), "nothing may be written"
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.slow
def test_corrupted_copy_through_sweep_grid_data_dir(tmp_path):
    bad, cwd = tmp_path / "bad", tmp_path / "run"
    for d in (bad, cwd):
        d.mkdir()
    (bad / CONV).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    env = {**os.environ, **OFFLINE, "SWEEP_DATA_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [script("sweep-grid"), "workload=azure_conv_2023", "hardware=h100_sxm",
         "model=qwen3_8b", "grid=small", f"data_dir={bad}"], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"the copy {bad / CONV} has sha256" in lines[0]
    assert not any(cwd.iterdir())


def run_data(args, env):
    return subprocess.run([script("sweep-data"), *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.slow
def test_sweep_data_list_and_fetch(tmp_path):
    folder = tmp_path / "copies"
    folder.mkdir()
    (folder / CONV).write_text("not the trace\n")
    env = {**os.environ, **OFFLINE, "SWEEP_DATA_DIR": str(folder),
           "SWEEP_DATA_CACHE": str(tmp_path / "cache")}
    proc = run_data(["list"], env)
    assert proc.returncode == 0, proc.stderr
    for name, t in REGISTRY.items():
        assert f"{name}  {t.size_bytes:,} bytes  {t.license}" in proc.stdout
        assert t.url in proc.stdout
    assert f"{CONV}  719,188 bytes  CC-BY-4.0  local, sha256 differs:" in proc.stdout
    assert "azure_llm_2023_code.csv  320,117 bytes  CC-BY-4.0  not fetched" in (
        proc.stdout)
    assert f"local copies: {folder}" in proc.stdout
    if SHARED_DATA is not None:
        proc = run_data(["list", "--data-dir", str(SHARED_DATA)], env)
        assert proc.stdout.count("local, verified") == len(REGISTRY), proc.stdout
        proc = run_data(["fetch", "--data-dir", str(SHARED_DATA)], env)
        assert proc.returncode == 0, proc.stderr
        assert f"{CONV}: {SHARED_DATA / CONV}" in proc.stdout
    for args in (["fetch", CONV, "nope.csv"], ["fetch", "azure_llm_2023_code.csv"],
                 ["fetch", CONV], ["lst"]):
        proc = run_data(args, env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert "nope.csv: not a registered public trace" in run_data(
        ["fetch", "nope.csv"], env).stderr
    proc = subprocess.run([sys.executable, "-m", "sweep.data", "list", CONV],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(CONV), proc.stderr

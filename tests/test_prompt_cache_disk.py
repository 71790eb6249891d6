"""The disk tier of the prompt cache: it survives restarts, stays within its byte budget,
never serves another model's or layout's state, shrugs off damaged files, and is shared safely
by two servers."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
from pathlib import Path

import httpx
import numpy as np

from fastrun_cpp.engine import disk_cache
from fastrun_cpp.engine.disk_cache import DiskPromptCache, file_identity

from tests.server import DEFAULT_MODEL, run_server
from tests.test_prefix_cache import Client, cached, document, text


def entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*/*.kv"))


def disk_stats(client: Client) -> dict:
    health = httpx.get(f"{client.base_url.removesuffix('/v1')}/health").json()
    return health["models"][client.model]["disk_cache"]


def test_a_restart_keeps_the_prefixes(tmp_path):
    """...with other slots, and in files only their owner can read (states of users' prompts)."""
    cache_dir = tmp_path / "cache"
    env = {"FASTRUN_PROMPT_CACHE_DIR": str(cache_dir)}
    prompt = document("lighthouses", 60)
    with run_server("--slots", "2", log_dir=tmp_path, env=env) as server:
        before = Client(server.base_url).complete(prompt)
    assert len(entries(cache_dir)) == 1  # the slot's content, saved at shutdown
    modes = {path.relative_to(tmp_path): oct(path.stat().st_mode & 0o777)
             for path in [cache_dir, *cache_dir.rglob("*")]}
    assert modes == {path: "0o700" if (tmp_path / path).is_dir() else "0o600" for path in modes}, modes
    with run_server("--slots", "3", log_dir=tmp_path, env=env) as server:
        client = Client(server.base_url)
        after = client.complete(prompt)
        assert cached(after) == after["usage"]["prompt_tokens"] - 1
        assert text(after) == text(before)
        assert disk_stats(client)["hits"] == 1
        metrics = httpx.get(f"{server.root_url}/metrics").text
        assert f'fastrun_prompt_cache_disk_total{{event="hit",model="{DEFAULT_MODEL}"}} 1.0' in metrics
        assert 'fastrun_prompt_cache_lookups_total{model="' + DEFAULT_MODEL + '",outcome="disk"} 1.0' in metrics


def test_damaged_and_foreign_files_are_skipped(tmp_path):
    cache_dir = tmp_path / "cache"
    env = {"FASTRUN_PROMPT_CACHE_DIR": str(cache_dir)}
    prompts = [document(topic, 40) for topic in ("kettles", "ladders", "mirrors")]
    with run_server("--slots", "1", log_dir=tmp_path, env=env) as server:
        client = Client(server.base_url)
        cold = [client.complete(p) for p in prompts]  # each new prompt saves the previous one
    files = entries(cache_dir)
    assert len(files) == 3
    namespace = files[0].parent
    files[0].write_bytes(files[0].read_bytes()[: files[0].stat().st_size // 2])  # truncated
    damaged = bytearray(files[1].read_bytes())
    damaged[-100] ^= 0xFF  # one flipped byte in the state
    files[1].write_bytes(bytes(damaged))
    (namespace / ("0" * 64 + ".kv")).write_bytes(b"not a cache file at all")
    (namespace / ("f" * 64 + ".kv")).write_bytes(b"FASTRUN-KV\x01\n\xff\xff\xff\xff")
    with run_server("--slots", "1", log_dir=tmp_path, env=env) as server:
        client = Client(server.base_url)
        answers = [client.complete(p) for p in prompts]
        assert [text(a) for a in answers] == [text(c) for c in cold]
        assert disk_stats(client)["skipped"] >= 3
        assert "prompt cache: skipping" in server.log()
        assert server.process.poll() is None


def test_the_disk_tier_stays_within_its_budget(tmp_path):
    cache_dir = tmp_path / "cache"
    budget = 0.05  # GiB: room for a few 40-fact prefixes (~15 MiB each)
    with run_server("--slots", "1", "--prompt-cache-disk-gib", str(budget), log_dir=tmp_path,
                    env={"FASTRUN_PROMPT_CACHE_DIR": str(cache_dir)}) as server:
        client = Client(server.base_url)
        for topic in ("apples", "birches", "cedars", "dunes", "eagles", "ferns", "geysers", "hollows"):
            client.complete(document(topic, 40), max_tokens=2)
        stats = disk_stats(client)
    assert stats["evictions"] >= 1
    assert sum(f.stat().st_size for f in entries(cache_dir)) <= budget * 2**30


def test_another_kv_layout_never_matches(tmp_path):
    """States of the deterministic and the fast kernels live apart (the same KV types, rounded
    differently)."""
    env = {"FASTRUN_PROMPT_CACHE_DIR": str(tmp_path / "cache")}
    prompt = document("quarries", 40)
    with run_server("--slots", "1", log_dir=tmp_path, env=env) as server:
        Client(server.base_url).complete(prompt)
    with run_server("--slots", "1", "--no-deterministic", log_dir=tmp_path, env=env) as server:
        client = Client(server.base_url)
        assert cached(client.complete(prompt)) == 0
    assert len({f.parent for f in entries(tmp_path / "cache")}) == 2


def test_two_servers_share_one_directory(tmp_path):
    """Both write and read the same directory at once; each finds the other's prefixes after
    a restart, and every file stays readable."""
    cache_dir = tmp_path / "cache"
    env = {"FASTRUN_PROMPT_CACHE_DIR": str(cache_dir)}
    topics = [f"shared {word}" for word in ("anchors", "buoys", "cranes", "docks", "eddies", "flares")]
    # One thread each: two servers spinning two threads apiece on two cores thrash.
    with run_server("--slots", "1", "--threads", "1", log_dir=tmp_path, env=env) as one, \
            run_server("--slots", "1", "--threads", "1", log_dir=tmp_path, env=env) as two:
        clients = [Client(one.base_url), Client(two.base_url)]

        def work(index: int) -> list[dict]:
            client = clients[index % 2]
            return [client.complete(document(topic, 30), max_tokens=4) for topic in topics[index % 2::2]]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = [answer for answers in pool.map(work, range(2)) for answer in answers]
    with run_server("--slots", "1", log_dir=tmp_path, env=env) as server:
        client = Client(server.base_url)
        again = [client.complete(document(topic, 30), max_tokens=4) for topic in topics]
        hits = disk_stats(client)["hits"]
        assert disk_stats(client)["skipped"] == 0
    assert hits >= len(topics) - 1  # every prefix either server left behind, but the slot's last
    assert sorted(text(a) for a in again) == sorted(text(a) for a in first)


def test_states_waiting_for_a_slow_disk_are_bounded_in_bytes(tmp_path, monkeypatch):
    """A disk slower than the saves costs hits (dropped writes, counted), never memory."""
    monkeypatch.setattr(disk_cache, "WRITE_QUEUE_BYTES", 5 * 2**20 // 2)
    release = threading.Event()
    cache = DiskPromptCache(tmp_path, "ns", 1 << 30)
    write = cache._write
    monkeypatch.setattr(cache, "_write", lambda *item: (release.wait(30), write(*item)))
    states = [np.full(2**20, i, dtype=np.uint8) for i in range(4)]
    for i, state in enumerate(states):
        cache.store([i] * 64, state)
    assert cache.stats.dropped == 2  # 2 MiB wait (one in the writer's hands): a third would pass 2.5 MiB
    release.set()
    assert cache.flush(30)
    assert cache.stats.writes == 2 and cache.stats.entries == 2
    cache.store([9] * 64, states[0])  # the queue is empty again: writes are accepted
    assert cache.flush(30) and cache.stats.writes == 3
    cache.close()


def test_a_model_is_known_by_its_content_hashed_once(tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    ends = os.urandom(2**20)
    first.write_bytes(ends + b"middle one" + ends)
    second.write_bytes(ends + b"middle two" + ends)  # same size, same first and last MiB
    known = tmp_path / "cache" / disk_cache.IDENTITIES_FILE
    identity = file_identity(first, known)
    assert identity["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert file_identity(second, known) != identity
    # Kept by path, size and mtime: the same file is not read again...
    stat = first.stat()
    first.write_bytes(ends + b"middle six" + ends)
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_identity(first, known) == identity
    # ...until one of them changes.
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert file_identity(first, known)["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest() != identity["sha256"]


def test_a_hugging_face_blob_is_named_by_its_hash(tmp_path):
    content = b"GGUF weights"
    blob = tmp_path / "blobs" / hashlib.sha256(content).hexdigest()
    blob.parent.mkdir()
    blob.write_bytes(content)
    link = tmp_path / "model.gguf"
    link.symlink_to(blob)
    assert file_identity(link, None)["sha256"] == blob.name


def test_states_on_disk_name_the_build_that_computed_them():
    """The library was built by scripts/build_llama_cpp_python.sh with this checkout's patches,
    and says so: the disk tier's namespace includes it, so a build with other patches or
    options never reads states computed by other arithmetic."""
    from fastrun_cpp.runtime.model_runtime import llama_cpp_build

    build = llama_cpp_build()
    assert build is not None, "llama-cpp-python was not built by scripts/build_llama_cpp_python.sh"
    patches = sorted((Path(__file__).parents[1] / "patches" / "llama.cpp").glob("*.patch"))
    assert build["patches_sha256"] == hashlib.sha256(b"".join(p.read_bytes() for p in patches)).hexdigest()
    assert "-DGGML_LLAMAFILE=ON" in build["cmake_args"]

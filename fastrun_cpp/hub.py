"""GGUF files from the Hugging Face Hub, through huggingface-hub and its standard cache.

Files pulled here are the files `huggingface-cli download` pulls (and the other way round);
downloads resume, show a progress bar, and honour HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

_SHARD = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")

# huggingface-hub is imported where it is used: it takes about 0.4 s to import, and
# a server whose models are all local files never needs it.


class HubError(Exception):
    """A model could not be fetched: the message says why, for people."""


class PullStopped(HubError):
    """A download stopped on purpose: too large, more bytes than the file has, or cancelled."""


# (file, bytes so far, bytes in all if known): called as a download goes.
Progress = Callable[[str, int, int | None], None]


def _watched(filename: str, progress: Progress | None, max_bytes: int | None, stop: Callable[[], bool] | None):
    """huggingface-hub's progress bar, reporting each step to `progress` and stopping a download
    past `max_bytes`, past the size the Hub gave for it, or when `stop()` says so. It is shown
    also when stderr is not a terminal (server logs), unless HF_HUB_DISABLE_PROGRESS_BARS asks
    for silence."""
    from huggingface_hub import constants
    from huggingface_hub.utils import tqdm as hub_tqdm

    class Watched(hub_tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = constants.HF_HUB_DISABLE_PROGRESS_BARS is True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            done, total = int(self.n), int(self.total) if self.total else None
            if progress is not None:
                progress(filename, done, total)
            if max_bytes is not None and done > max_bytes:
                raise PullStopped(f"{filename} is over the {max_bytes // 2**20} MiB a pull may fetch (--pull-max-gib)")
            if total is not None and done > total:
                raise PullStopped(f"the Hub sent more of {filename} than its {total} bytes")
            if stop is not None and stop():
                raise PullStopped(f"the pull of {filename} was cancelled")
            return shown

    return Watched


def shard_names(filename: str) -> list[str]:
    """All parts of a sharded GGUF (`x-00001-of-00003.gguf`), or just `filename`."""
    match = _SHARD.match(filename)
    if not match:
        return [filename]
    count = int(match["count"])
    return [f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def is_projector(name: str) -> bool:
    """A vision projector (mmproj) GGUF, by llama.cpp's naming: not a model of its own."""
    return name.endswith(".gguf") and name.rsplit("/", 1)[-1].lower().startswith("mmproj")


def gguf_models(files: Iterable[str]) -> list[str]:
    """The GGUF models among `files`, sorted: each plain GGUF, and the first shard of each sharded
    one; projectors (mmproj*.gguf) are not models."""
    return sorted(f for f in files if f.endswith(".gguf") and not is_projector(f)
                  and (not _SHARD.match(f) or _SHARD.match(f)["index"] == "00001"))


# Of several projectors in a repository, the first kind found wins: the precision they were
# trained in first (llama.cpp's converters write f16 by default), quantized ones last.
_PROJECTOR_KINDS = ("f16", "bf16", "f32", "q8_0")


def choose_projector(files: Iterable[str]) -> str | None:
    """The vision projector among a repository's files (None: it has none)."""
    projectors = sorted(f for f in files if is_projector(f))
    for kind in _PROJECTOR_KINDS:
        for name in projectors:
            if kind in re.split(r"[-_.]", name.rsplit("/", 1)[-1].lower()):
                return name
    return projectors[0] if projectors else None


def pull_projector(repo: str, *, revision: str | None = None) -> Path | None:
    """The vision projector a model's repository holds, pulled (or found in the cache), as
    llama-server's -hf does; None when it holds none. Without the network, the cached
    snapshot's files are what the repository holds."""
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(repo, revision=revision)
    except Exception:  # noqa: BLE001 - offline mode, no network, an HTTP error: the types move between versions
        snapshot = _main_snapshot(repo)
        files = [path.name for path in snapshot.iterdir()] if snapshot is not None else []
    name = choose_projector(files)
    return pull(repo, name, revision=revision) if name is not None else None


def choose_gguf(files: list[str], repo: str) -> str:
    """The one GGUF of a repository (the first shard of a sharded one)."""
    first_shards = gguf_models(files)
    if len(first_shards) == 1:
        return first_shards[0]
    if not first_shards:
        raise HubError(f"{repo} has no .gguf file")
    listing = ", ".join(first_shards[:10])
    raise HubError(f"{repo} has several GGUF files; name one ({listing})")


def pull(repo: str, filename: str | None = None, *, revision: str | None = None, progress: Progress | None = None,
         max_bytes: int | None = None, stop: Callable[[], bool] | None = None) -> Path:
    """Download (or find in the cache) a GGUF and return its local path; all shards of a
    sharded model are fetched and the first one returned (llama.cpp reads the rest).

    With `max_bytes`, a model larger than that (all shards) is refused before any download,
    and a download that runs past it (a server sending more than it said) is stopped."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    try:
        if filename is None:
            filename = choose_gguf(HfApi().list_repo_files(repo, revision=revision), repo)
        names = shard_names(filename)
        if max_bytes is not None:
            uncached = [name for name in names if not isinstance(try_to_load_from_cache(repo, name, revision=revision),
                                                                   str)]
            sizes = [get_hf_file_metadata(hf_hub_url(repo, name, revision=revision)).size or 0 for name in uncached]
            if sum(sizes) > max_bytes:
                raise PullStopped(f"{repo}/{filename} is {sum(sizes) // 2**20} MiB, over the {max_bytes // 2**20} MiB "
                                  "a pull may fetch (--pull-max-gib)")
        paths = []
        for name in names:
            try:
                paths.append(Path(hf_hub_download(repo, name, revision=revision,
                                                  tqdm_class=_watched(name, progress, max_bytes, stop))))
            except PullStopped:
                _drop_incomplete(repo)  # what an endless or oversized download wrote, not kept to resume
                raise
    except GatedRepoError as exc:
        raise HubError(f"{repo} is gated: accept its terms on the Hub and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"no repository {repo} on the Hub (or it is private: set HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"{repo} has no revision {revision!r}") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:  # before EntryNotFoundError: a subclass
        raise HubError(
            f"{repo}/{filename or '*.gguf'} is not in the local cache and the Hub cannot be reached "
            "(HF_HUB_OFFLINE is set, or there is no network)"
        ) from exc
    except EntryNotFoundError as exc:
        raise HubError(f"{repo} has no file {filename!r}") from exc
    except HfHubHTTPError as exc:
        raise HubError(f"the Hub refused {repo}/{filename}: {exc}") from exc
    return paths[0]


def _repo_cache(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))


def _drop_incomplete(repo: str) -> None:
    for partial in (_repo_cache(repo) / "blobs").glob("*.incomplete"):
        partial.unlink(missing_ok=True)


def cached_gguf(repo: str, filename: str | None = None) -> str | None:
    """The GGUF of `repo` the local Hub cache holds (its name; every shard present), or None;
    without `filename`, the repository's one GGUF. Never touches the network."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    if filename is None:
        snapshot = _main_snapshot(repo)
        if snapshot is None:
            return None
        try:
            filename = choose_gguf([path.name for path in snapshot.iterdir()], repo)
        except HubError:
            return None
    try:
        if all(isinstance(try_to_load_from_cache(repo, name), str) for name in shard_names(filename)):
            return filename
    except HFValidationError:  # an id of our pattern the Hub's rules still refuse (a--b/c): no such model
        return None
    return None


def _main_snapshot(repo: str) -> Path | None:
    cache = _repo_cache(repo)
    try:
        commit = (cache / "refs" / "main").read_text(encoding="ascii").strip()
    except OSError:
        return None
    snapshot = cache / "snapshots" / commit
    return snapshot if re.fullmatch(r"[0-9a-f]{40}", commit) and snapshot.is_dir() else None


def cached_models(limit: int = 256) -> list[str]:
    """Hub ids of the GGUF models in the local cache (owner/name for a repository's only GGUF,
    owner/name:file.gguf for each of several)."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    try:
        folders = sorted(folder.name for folder in root.iterdir() if folder.name.startswith("models--"))
    except OSError:
        return []
    ids: list[str] = []
    for folder in folders[: limit * 4]:
        repo = folder[len("models--"):].replace("--", "/", 1)
        snapshot = _main_snapshot(repo)
        if snapshot is None:
            continue
        ggufs = gguf_models(path.name for path in snapshot.iterdir())
        ids += [repo] if len(ggufs) == 1 else [f"{repo}:{name}" for name in ggufs]
        if len(ids) >= limit:
            break
    return ids[:limit]

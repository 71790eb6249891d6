"""GGUF files from the Hugging Face Hub, through huggingface-hub and its standard cache.

Files pulled here are the files `huggingface-cli download` pulls (and the other way round);
downloads resume, show a progress bar, and honour HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.utils import tqdm as hub_tqdm
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

_SHARD = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _Progress(hub_tqdm):
    """huggingface-hub's progress bar, shown also when stderr is not a terminal (server logs),
    unless HF_HUB_DISABLE_PROGRESS_BARS asks for silence."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["disable"] = constants.HF_HUB_DISABLE_PROGRESS_BARS is True
        super().__init__(*args, **kwargs)


class HubError(Exception):
    """A model could not be fetched: the message says why, for people."""


def shard_names(filename: str) -> list[str]:
    """All parts of a sharded GGUF (`x-00001-of-00003.gguf`), or just `filename`."""
    match = _SHARD.match(filename)
    if not match:
        return [filename]
    count = int(match["count"])
    return [f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def choose_gguf(files: list[str], repo: str) -> str:
    """The one GGUF of a repository (the first shard of a sharded one)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    first_shards = [f for f in ggufs if not _SHARD.match(f) or _SHARD.match(f)["index"] == "00001"]
    if len(first_shards) == 1:
        return first_shards[0]
    if not first_shards:
        raise HubError(f"{repo} has no .gguf file")
    listing = ", ".join(first_shards[:10])
    raise HubError(f"{repo} has several GGUF files; name one ({listing})")


def pull(repo: str, filename: str | None = None, *, revision: str | None = None) -> Path:
    """Download (or find in the cache) a GGUF and return its local path; all shards of a
    sharded model are fetched and the first one returned (llama.cpp reads the rest)."""
    try:
        if filename is None:
            filename = choose_gguf(HfApi().list_repo_files(repo, revision=revision), repo)
        paths = [Path(hf_hub_download(repo, name, revision=revision, tqdm_class=_Progress))
                 for name in shard_names(filename)]
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

"""Models on the Hugging Face Hub: ``org/name[@revision]`` and ``org/name[@revision]:QUANT``.

A checkpoint repo is fetched with ``huggingface_hub.snapshot_download`` (only its config,
safetensors weights and index, and tokenizer files) and loads like a checkpoint folder; a GGUF
repo gets one file with ``hf_hub_download``, chosen by quantization (``:Q4_K_M``, matched
case-insensitively in the file names) or by name (``:model-q8_0.gguf``), and loads like a local
``.gguf``. Everything else is huggingface_hub's: its cache (``HF_HUB_CACHE`` / ``HF_HOME``), its
token (``HF_TOKEN`` or ``hf auth login``), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE=1``, its
progress bars. Its errors become one-line :class:`HubError` messages that say what to do.

:func:`specfork.loading.registry.resolve_model` asks here last: an existing local path and a
packaged model name of the same spelling win over a Hub id.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specfork.errors import ConfigError

log = logging.getLogger(__name__)

#: What a checkpoint download fetches: the config, the safetensors weights (and their index),
#: the tokenizer and the generation defaults. Never .bin/.pt/.gguf/onnx files.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
LOGIN_HINT = "set HF_TOKEN or run `hf auth login` (`huggingface-cli login`)"

_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
    r"(?:@(?P<revision>[^:@\s]+))?"
    r"(?::(?P<file>[^:@\s]+))?"
)
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class HubError(ConfigError):
    """A Hugging Face Hub model could not be fetched; the message says how to fix it."""


class HubRepoNotFoundError(HubError):
    """No such repo (or a private one the token cannot see)."""


class HubRevisionNotFoundError(HubError):
    """The repo exists but has no such branch, tag or commit."""


class HubAccessError(HubError):
    """A gated or private repo asked for a token (HTTP 401/403)."""


class HubOfflineError(HubError):
    """The Hub cannot be reached (offline mode or no network) and nothing usable is cached."""


class HubContentError(HubError):
    """The repo holds no model specfork loads, or the GGUF selection does not name one file."""


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub model id: ``repo_id``, an optional ``revision`` (branch, tag or commit)
    and an optional GGUF ``selector`` (a quantization such as Q4_K_M, or a .gguf file name)."""

    repo_id: str
    revision: str | None = None
    selector: str | None = None

    def __post_init__(self) -> None:
        if self.repo_id.count("/") != 1 or "--" in self.repo_id or ".." in self.repo_id:
            raise ConfigError(f"{self.repo_id!r} is not a Hugging Face repo id; use org/name")

    @classmethod
    def parse(cls, text: str) -> HubRef | None:
        """The Hub id ``text`` spells, or None when it is not shaped like one."""
        match = _HUB_ID.fullmatch(text.strip())
        if match is None or "--" in match["repo"] or ".." in match["repo"]:
            return None
        return cls(match["repo"], match["revision"], match["file"])

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{at}{':' + self.selector if self.selector else ''}"


@dataclass(frozen=True)
class HubModelStatus:
    """One cached revision of a Hub model repo, for ``specfork models``."""

    repo_id: str
    revision: str  # commit hash
    refs: tuple[str, ...]  # branches and tags that point at it
    size: int  # bytes on disk
    path: Path  # the snapshot folder
    kind: str  # "safetensors", "gguf" or "incomplete"
    gguf_files: tuple[str, ...]


def resolve_hub(ref: HubRef, *, progress: bool = True) -> Path:
    """The local path of a Hub model: a checkpoint folder, or a GGUF file when ``ref`` selects
    one (or when the repo's only weights are exactly one GGUF file). Downloads what is missing.

    Raises:
        HubError: the repo, revision or file does not exist, needs a token, cannot be reached,
            or holds nothing specfork loads.
    """
    if ref.selector is not None:
        return _download_gguf(ref, _select_gguf(ref, _gguf_files(ref)), progress=progress)
    folder = _download_checkpoint(ref, progress=progress)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    return _not_a_checkpoint(ref, folder, progress=progress)


def _not_a_checkpoint(ref: HubRef, folder: Path, *, progress: bool) -> Path:
    """A repo without config + safetensors: its one GGUF file, or an error saying what to pass."""
    ggufs = _gguf_files(ref)
    if len(ggufs) == 1:
        log.info("%s has no safetensors checkpoint; loading its GGUF file %s", ref, ggufs[0])
        return _download_gguf(ref, ggufs[0], progress=progress)
    if ggufs:
        raise HubContentError(
            f"{ref} holds GGUF files, not a safetensors checkpoint; pick one with "
            f"{ref.repo_id}:QUANT (e.g. :Q4_K_M) or {ref.repo_id}:FILE.gguf — files: "
            f"{_file_list(ggufs)}"
        )
    has_config = (folder / "config.json").is_file()
    missing = "safetensors weights" if has_config else "config.json and safetensors weights"
    raise HubContentError(
        f"{ref} has no {missing} and no GGUF file, so specfork cannot load it; pass a repo with "
        f"a safetensors checkpoint (config.json + *.safetensors) or GGUF files"
    )


# --------------------------------------------------------------------------------------------
# Downloads
# --------------------------------------------------------------------------------------------


def _download_checkpoint(ref: HubRef, *, progress: bool) -> Path:
    from huggingface_hub import snapshot_download

    with hub_errors(ref):
        folder = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            allow_patterns=list(CHECKPOINT_FILES),
            tqdm_class=None if progress else _SilentBar,
        )
    log.info("%s is at %s", ref, folder)
    return Path(folder)


def _download_gguf(ref: HubRef, filename: str, *, progress: bool) -> Path:
    from huggingface_hub import hf_hub_download

    with hub_errors(ref, filename):
        path = hf_hub_download(
            ref.repo_id,
            filename,
            revision=ref.revision,
            tqdm_class=None if progress else _SilentBar,
        )
    log.info("%s (%s) is at %s", ref, filename, path)
    return Path(path)


class _SilentBar(tqdm):
    """huggingface_hub's progress bars, switched off (``progress=False``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# GGUF files: listing and selection
# --------------------------------------------------------------------------------------------


def _gguf_files(ref: HubRef) -> list[str]:
    """The repo's .gguf files (projector files excluded): from the Hub, or from the cache when
    the Hub cannot be reached. One request for the repo's info (its ``siblings``), not the
    paginated tree listing: huggingface_hub retries that one with backoff, so an unreachable Hub
    took ~25 s to be reported."""
    from huggingface_hub import HfApi

    try:
        with hub_errors(ref):
            info = HfApi().model_info(ref.repo_id, revision=ref.revision)
        files = [sibling.rfilename for sibling in info.siblings or ()]
    except HubOfflineError:
        files = _cached_files(ref)
        if not files:
            raise
        log.info("the Hub cannot be reached; choosing among the cached files of %s", ref)
    return sorted(f for f in files if _is_model_gguf(f))


def _is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not name.startswith("mmproj")


def _cached_files(ref: HubRef) -> list[str]:
    """The files of the cached snapshot of ``ref``'s revision (relative paths), if any."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(
        repo_id=ref.repo_id, repo_type="model"
    )
    revision = ref.revision or "main"
    commit = revision
    ref_file = storage / "refs" / revision
    if ref_file.is_file():
        commit = ref_file.read_text().strip()
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return []
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def select_gguf(selector: str, files: list[str]) -> str | list[str]:
    """The file ``selector`` names among ``files``: the file itself (a name ending in .gguf,
    matched as the path or the base name) or the one file whose name holds the quantization
    (as a whole word first, else anywhere; case-insensitive). A list of candidates when that is
    not exactly one file."""
    wanted = selector.lower()
    if wanted.endswith(".gguf"):
        hits = [f for f in files if f.lower() == wanted or f.rsplit("/", 1)[-1].lower() == wanted]
        return hits[0] if len(hits) == 1 else hits
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(selector)}(?![A-Za-z0-9_])", re.IGNORECASE)
    hits = [f for f in files if word.search(f.rsplit("/", 1)[-1])]
    if not hits:
        hits = [f for f in files if wanted in f.rsplit("/", 1)[-1].lower()]
    return hits[0] if len(hits) == 1 else hits


def _select_gguf(ref: HubRef, files: list[str]) -> str:
    assert ref.selector is not None
    if not files:
        raise HubContentError(
            f"{ref.repo_id} has no GGUF files, so :{ref.selector} selects nothing; drop "
            f":{ref.selector} to load its safetensors checkpoint"
        )
    chosen = select_gguf(ref.selector, files)
    if isinstance(chosen, str):
        return chosen
    if chosen and all(_SPLIT_PART.search(f) for f in chosen):
        raise HubContentError(
            f"{ref} is a GGUF split into {len(chosen)} files ({_file_list(chosen)}); specfork "
            f"loads single-file GGUFs: merge them with `llama-gguf-split --merge` and pass the file"
        )
    problem = f"matches {len(chosen)} GGUF files" if chosen else "matches no GGUF file"
    pick = "name one of" if chosen else "pass a quantization or file name from"
    shown = chosen or files
    raise HubContentError(f"{ref} {problem}; {pick} these: {_file_list(shown)}")


def _file_list(files: list[str], limit: int = 12) -> str:
    more = f", ... ({len(files) - limit} more)" if len(files) > limit else ""
    return ", ".join(files[:limit]) + more


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@contextmanager
def hub_errors(ref: HubRef, filename: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into :class:`HubError` subclasses (one line each)."""
    from huggingface_hub import errors

    try:
        yield
    except errors.RevisionNotFoundError as exc:
        raise HubRevisionNotFoundError(
            f"{ref.repo_id} has no revision {ref.revision!r} on the Hugging Face Hub; pass an "
            f"existing branch, tag or commit after @ (or none for the default branch)"
        ) from exc
    except errors.GatedRepoError as exc:
        raise HubAccessError(_access_message(ref, exc, gated=True)) from exc
    except errors.RepositoryNotFoundError as exc:
        raise HubRepoNotFoundError(
            f"{ref.repo_id!r} is neither a local path, a packaged model nor a model repo on the "
            f"Hugging Face Hub ({_endpoint()}); check the spelling, or if the repo is private, "
            f"{LOGIN_HINT}"
        ) from exc
    except getattr(errors, "IncompleteSnapshotError", ()) as exc:  # huggingface_hub >= 2
        raise HubOfflineError(
            f"the cached copy of {ref} is incomplete and the Hub cannot be reached to finish it; "
            f"{_offline_fix()}"
        ) from exc
    except errors.EntryNotFoundError as exc:  # a remote 404, or a file missing from the cache
        if isinstance(exc, errors.LocalEntryNotFoundError):
            raise _offline_error(ref, exc) from exc
        raise HubContentError(
            f"{ref} has no file {filename!r}; pass another quantization or file name"
        ) from exc
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubAccessError(_access_message(ref, exc, gated=False)) from exc
        raise HubError(
            f"the Hugging Face Hub answered HTTP {status} for {ref}: {_first_line(exc)}; "
            f"try again later"
        ) from exc
    except errors.OfflineModeIsEnabled as exc:
        raise _offline_error(ref, exc) from exc
    except _transport_errors() as exc:
        raise _offline_error(ref, exc) from exc
    except errors.HFValidationError as exc:
        raise HubRepoNotFoundError(
            f"{str(ref)!r} is not a valid Hugging Face repo id ({_first_line(exc)}); use "
            f"org/name[@revision][:QUANT]"
        ) from exc


def _access_message(ref: HubRef, exc: Exception, *, gated: bool) -> str:
    from huggingface_hub import get_token

    what = "is gated" if gated else "needs authorization"
    if get_token() is None:
        return f"{ref.repo_id} {what} on the Hugging Face Hub and no token is set; {LOGIN_HINT}"
    fix = (
        "accept its conditions on the repo's page with the account of your token"
        if gated
        else "check that your token (HF_TOKEN or `hf auth login`) can read it"
    )
    return f"{ref.repo_id} {what} and your token was refused; {fix}"


def _offline_error(ref: HubRef, exc: BaseException) -> HubOfflineError:
    from huggingface_hub import constants

    if _is_offline():
        return HubOfflineError(
            f"{ref} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE=1 forbids downloading it; unset HF_HUB_OFFLINE to download it, "
            f"or pass a local path"
        )
    cause = exc.__cause__ or exc
    return HubOfflineError(
        f"cannot reach the Hugging Face Hub at {_endpoint()} to fetch {ref} "
        f"({type(cause).__name__}: {_first_line(cause)}); {_offline_fix()}"
    )


def _offline_fix() -> str:
    return (
        "check the network (and HF_ENDPOINT, proxies), or set HF_HUB_OFFLINE=1 to use cached "
        "models only"
    )


def _is_offline() -> bool:
    from huggingface_hub import constants

    check: Callable[[], bool] | None = getattr(constants, "is_offline_mode", None)
    return check() if check is not None else bool(constants.HF_HUB_OFFLINE)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The network exception types of the HTTP client huggingface_hub uses (its versions use
    httpx2, httpx or requests), plus the builtin ones."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def hub_label(path: Path) -> str | None:
    """``org/name`` (``org/name/file.gguf`` for a GGUF file) when ``path`` lies in a snapshot
    of huggingface_hub's cache (``models--org--name/snapshots/<commit>/...``), else None."""
    parts = path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            repo_id = parts[i][len("models--") :].replace("--", "/", 1)
            inner = "/".join(parts[i + 3 :])
            return f"{repo_id}/{inner}" if path.suffix == ".gguf" and inner else repo_id
    return None


# --------------------------------------------------------------------------------------------
# The cache, for `specfork models`
# --------------------------------------------------------------------------------------------


def cached_hub_models() -> list[HubModelStatus]:
    """Every cached revision of a model repo in huggingface_hub's cache (no network)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    for warning in info.warnings:
        log.info("skipped in the Hugging Face cache: %s", warning)
    statuses = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: sorted(r.refs)):
            names = sorted(f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files)
            ggufs = tuple(n for n in names if _is_model_gguf(n))
            checkpoint = "config.json" in names and any(n.endswith(".safetensors") for n in names)
            kind = "safetensors" if checkpoint else "gguf" if ggufs else "incomplete"
            statuses.append(
                HubModelStatus(
                    repo_id=repo.repo_id,
                    revision=rev.commit_hash,
                    refs=tuple(sorted(rev.refs)),
                    size=rev.size_on_disk,
                    path=rev.snapshot_path,
                    kind=kind,
                    gguf_files=ggufs,
                )
            )
    return statuses

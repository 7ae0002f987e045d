"""A local stand-in for the Hugging Face Hub, reached through ``HF_ENDPOINT`` in the tests.

It serves just what ``huggingface_hub.snapshot_download`` / ``hf_hub_download`` /
``HfApi.model_info`` / ``HfApi.list_repo_files`` call, with the headers and error codes the
real Hub sends:

- ``GET /api/models/{org}/{name}/revision/{rev}``: the repo info (``sha``, ``siblings``);
  ``GET /api/models/{org}/{name}`` the same for the default branch (``model_info``);
- ``GET /api/models/{org}/{name}/tree/{rev}``: the file listing (``recursive`` ignored: flat);
- ``HEAD`` / ``GET /{org}/{name}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (plus
  ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS files, like the Hub), ``Content-Length``;
  no ``X-Xet-*`` headers, so huggingface_hub downloads over plain HTTP.

Errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) as the
Hub's do; a gated repo answers 401 unless the request has an ``Authorization`` header.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf")


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: dict[str, str] = field(default_factory=dict)
    gated: bool = False

    def resolve(self, revision: str) -> str | None:
        if revision == self.commit:
            return self.commit
        return {"main": self.commit, **self.branches}.get(revision)

    @classmethod
    def from_folder(cls, folder: Path, **kwargs: object) -> FakeRepo:
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        return cls(files=files, **kwargs)  # type: ignore[arg-type]


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[str] = field(default_factory=list)  # "METHOD path" of every request
    endpoint: str = ""


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            path = urlsplit(self.path).path
            hub.requests.append(f"{self.command} {path}")
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                self._api(parts[2] + "/" + parts[3], parts[4], parts[5], body)
            elif parts[:2] == ["api", "models"] and len(parts) == 4:  # the default branch's info
                self._api(parts[2] + "/" + parts[3], "revision", "main", body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
            else:
                self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"}, body)

        def _repo(self, repo_id: str, revision: str, body: bool) -> tuple[FakeRepo, str] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._send(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}, body)
                return None
            if repo.gated and not self.headers.get("Authorization"):
                msg = b"Access to this model is restricted; you must be authenticated"
                self._send(401, msg, {"X-Error-Code": "GatedRepo"}, body)
                return None
            commit = repo.resolve(revision)
            if commit is None:
                self._send(404, b"Invalid rev id", {"X-Error-Code": "RevisionNotFound"}, body)
                return None
            return repo, commit

        def _api(self, repo_id: str, kind: str, revision: str, body: bool) -> None:
            found = self._repo(repo_id, revision, body)
            if found is None:
                return
            repo, commit = found
            if kind == "revision":
                info = {
                    "id": repo_id,
                    "sha": commit,
                    "private": False,
                    "gated": False,
                    "siblings": [{"rfilename": name} for name in repo.files],
                }
            else:  # tree
                info = [self._tree_entry(name, data) for name, data in repo.files.items()]
            payload = json.dumps(info).encode()
            self._send(200, payload, {"Content-Type": "application/json"}, body)

        @staticmethod
        def _tree_entry(name: str, data: bytes) -> dict:
            entry = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            return entry

        def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            found = self._repo(repo_id, revision, body)
            if found is None:
                return
            repo, commit = found
            headers = {"X-Repo-Commit": commit}
            if name not in repo.files:
                self._send(
                    404, b"Entry not found", {**headers, "X-Error-Code": "EntryNotFound"}, body
                )
                return
            data = repo.files[name]
            if name.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                headers.update(
                    {
                        "ETag": f'"{sha}"',
                        "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(data)),
                    }
                )
            else:
                headers["ETag"] = f'"{_git_oid(data)}"'
            self._send(200, data, headers, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    """Run the fake Hub on a free local port in a thread; ``hub.endpoint`` is its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

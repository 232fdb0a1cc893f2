"""A throwaway package index on 127.0.0.1 serving crafted vLLM sdists (PEP 691 JSON or HTML)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_sdist(version: str, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    """A minimal vLLM sdist: vllm/__init__.py, a scheduler module, requirements/common.txt."""
    buf = io.BytesIO()
    top = f"vllm-{version}"
    files = {
        f"{top}/vllm/__init__.py": f"__version__ = '{version}'\n",
        f"{top}/vllm/v1/core/sched/scheduler.py": "class Scheduler: pass\n",
        f"{top}/requirements/common.txt": "numpy\n",
        f"{top}/requirements/cpu.txt": "-r common.txt\ntorch==2.6.0+cpu\n",
        f"{top}/csrc/kernel.cu": "// not extracted\n",
    }
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tf.addfile(info, io.BytesIO(b"x" * info.size) if info.size else None)
    return buf.getvalue()


class FakeIndex:
    """``files``: {filename: bytes}; ``hashes`` overrides the advertised sha256 per filename."""

    def __init__(self, files: dict[str, bytes], hashes: dict[str, str] | None = None,
                 html: bool = False):
        self.files = files
        self.hashes = hashes or {}
        self.html = html
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                index.requests.append(self.path)
                if self.path.rstrip("/") == "/simple/vllm":
                    entries = [{"filename": n, "url": f"/files/{n}",
                                "hashes": {"sha256": index.hashes.get(n) or hashlib.sha256(b).hexdigest()},
                                "size": len(b), "upload-time": "2025-08-20T23:17:16Z"}
                               for n, b in index.files.items()]
                    if index.html:
                        body = "<html><body>" + "".join(
                            f'<a href="{e["url"]}#sha256={e["hashes"]["sha256"]}">{e["filename"]}</a>'
                            for e in entries) + "</body></html>"
                        self._send(200, body.encode(), "text/html")
                    else:
                        body = json.dumps({"meta": {"api-version": "1.1"}, "name": "vllm",
                                           "files": entries}).encode()
                        self._send(200, body, "application/vnd.pypi.simple.v1+json")
                elif self.path.startswith("/files/"):
                    name = self.path[len("/files/"):]
                    if name in index.files:
                        self._send(200, index.files[name], "application/octet-stream")
                    else:
                        self._send(404, b"", "text/plain")
                else:
                    self._send(404, b"", "text/plain")

            def _send(self, code, body, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

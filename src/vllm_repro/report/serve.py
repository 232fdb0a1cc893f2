"""The reports server: ``reports/`` over HTTP on loopback, with the lab's text files as text.

``python -m vllm_repro.report.serve [--bind 127.0.0.1] [--directory reports] [PORT]`` (compose's
``reports`` service, and the browser test of the pages). The standard library's
``http.server`` with one change: ``trace.jsonl``, ``engine.log``, ``scenario.yaml`` and the
other text files a report holds are served as ``text/plain; charset=utf-8``, so a browser shows
them instead of downloading them (``http.server`` says ``application/octet-stream`` for
``.jsonl`` and ``.log``). Stops on SIGTERM and SIGINT.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: suffix -> content type for what a report holds beyond HTML and PNG
TEXT_TYPES = {
    ".jsonl": "text/plain; charset=utf-8",
    ".log": "text/plain; charset=utf-8",
    ".yaml": "text/plain; charset=utf-8",
    ".yml": "text/plain; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".diff": "text/plain; charset=utf-8",
    ".json": "application/json; charset=utf-8",
    ".svg": "image/svg+xml",
}


class ReportsHandler(SimpleHTTPRequestHandler):
    """``SimpleHTTPRequestHandler`` with :data:`TEXT_TYPES` first."""

    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **TEXT_TYPES}

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
        sys.stderr.write(f"reports: {self.address_string()} {format % args}\n")


def make_server(directory: Path, port: int = 8080, bind: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server of ``directory`` on ``bind:port`` (port 0: any free one; the bound port is
    ``server.server_address[1]``). Raises ``OSError`` when the port cannot be bound."""
    handler = functools.partial(ReportsHandler, directory=str(directory))
    return ThreadingHTTPServer((bind, port), handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_repro.report.serve",
                                     description="Serve a reports folder (text files as text).")
    parser.add_argument("port", nargs="?", type=int, default=8080)
    parser.add_argument("--bind", default="127.0.0.1", help="address (compose: 0.0.0.0 in the "
                        "container, published on the host's 127.0.0.1 only)")
    parser.add_argument("--directory", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"reports: {args.directory}: no such folder", file=sys.stderr)
        return 2
    server = make_server(args.directory, args.port, args.bind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"reports: serving {args.directory} on http://{args.bind}:{server.server_address[1]}/",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

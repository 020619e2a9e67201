"""``python -m fastload.testing ROOT [--s3] [--tls] [--realistic]``: a loopback HTTP (or S3)
server in a process of its own."""

from __future__ import annotations

import threading

from fastload.testing.faults import RemoteBehavior
from fastload.testing.http_server import LoopbackServer, RangeHTTPServer
from fastload.testing.s3_folder import S3FolderServer


def main(argv: list[str] | None = None) -> None:
    """Serve a directory from its own process (so its work does not share the client's GIL).

    Prints one JSON line, ``{"url": ..., "ca_file": ...}`` (``ca_file`` is the PEM file of
    the authority to trust with ``--tls``, else null), then serves until stdin closes or
    SIGTERM arrives.
    """
    import argparse
    import json
    import signal
    import sys

    parser = argparse.ArgumentParser(prog="python -m fastload.testing")
    parser.add_argument("root")
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--bandwidth-bytes-per-s", type=float, default=None)
    parser.add_argument("--s3", action="store_true", help="speak S3 (each subfolder a bucket)")
    parser.add_argument("--tls", action="store_true", help="serve https (a fresh private CA)")
    parser.add_argument(
        "--realistic",
        action="store_true",
        help="RemoteBehavior.realistic(): lognormal latency and 503 SlowDown bursts",
    )
    parser.add_argument(
        "--behavior", default=None, help="RemoteBehavior's fields as JSON (overrides the rest)"
    )
    args = parser.parse_args(argv)
    if args.behavior is not None:
        behavior = RemoteBehavior(**json.loads(args.behavior))
    elif args.realistic:
        behavior = RemoteBehavior.realistic()
    else:
        behavior = RemoteBehavior(
            latency_s=args.latency_s, bandwidth_bytes_per_s=args.bandwidth_bytes_per_s
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server: LoopbackServer
    if args.s3:
        server = S3FolderServer(args.root, behavior=behavior, tls=args.tls)
    else:
        server = RangeHTTPServer(args.root, behavior=behavior, tls=args.tls)
    with server:
        ca_file = None if server.ca_file is None else str(server.ca_file)
        print(json.dumps({"url": server.url, "ca_file": ca_file}), flush=True)

        def stop_when_stdin_closes() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=stop_when_stdin_closes, daemon=True).start()
        stop.wait()


if __name__ == "__main__":
    main()

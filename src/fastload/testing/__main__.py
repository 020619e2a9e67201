"""``python -m fastload.testing ROOT [--s3]``: a loopback HTTP (or S3) server in a process
of its own."""

from __future__ import annotations

import threading

from fastload.testing.faults import RemoteBehavior
from fastload.testing.http_server import LoopbackServer, RangeHTTPServer
from fastload.testing.s3_folder import S3FolderServer


def main(argv: list[str] | None = None) -> None:
    """Serve a directory from its own process (so its work does not share the client's GIL).

    Prints the base URL on one line, then serves until stdin closes or SIGTERM arrives.
    """
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(prog="python -m fastload.testing")
    parser.add_argument("root")
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--bandwidth-bytes-per-s", type=float, default=None)
    parser.add_argument("--s3", action="store_true", help="speak S3 (each subfolder a bucket)")
    args = parser.parse_args(argv)
    behavior = RemoteBehavior(
        latency_s=args.latency_s, bandwidth_bytes_per_s=args.bandwidth_bytes_per_s
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server_class: type[LoopbackServer] = S3FolderServer if args.s3 else RangeHTTPServer
    with server_class(args.root, behavior=behavior) as server:
        print(server.url, flush=True)

        def stop_when_stdin_closes() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=stop_when_stdin_closes, daemon=True).start()
        stop.wait()


if __name__ == "__main__":
    main()

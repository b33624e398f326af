"""torchft's servers bound to the one address a replica group is given (issue 34), not every interface.

torchft 0.2.0 takes no address for two of the servers its Manager starts: the ManagerServer is built with
bind=f"[::]:{port}" (torchft/manager.py), and the HTTP checkpoint transport's server with ("", 0) on an IPv6 socket
(torchft/checkpointing/http_transport.py), both every interface; the transport also advertises the machine's
hostname, whatever it resolves to. Here the transport is a subclass that binds and advertises `host`, and while the
Manager is built its ManagerServer constructor is one that binds `host` at the port torchft chose. The lighthouse
takes a bind address of its own (LighthouseServer(bind=...), torchft_lighthouse --bind). Imported only with
fault_tolerance on: it imports torchft.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

import torchft.manager
from torchft.checkpointing import http_transport


def url_host(host: str) -> str:
    """`host` as a URL spells it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def _replaced(module: object, name: str, value: object) -> Iterator[None]:
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


def _http_server_on(host: str) -> type[ThreadingHTTPServer]:
    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        request_queue_size = 1024  # as torchft's _IPv6HTTPServer

        def __init__(self, address: tuple[str, int], handler: Any) -> None:
            super().__init__((host, address[1]), handler)  # torchft asks for ("", 0): every interface

    return Server


class BoundHTTPTransport(http_transport.HTTPTransport):
    """torchft's HTTP checkpoint transport (what a healing group fetches a live peer's state from), listening on
    `host` only and advertising it. `received_from`: the peer address of the last state received."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self.host, self.received_from = host, ""
        with _replaced(http_transport, "_IPv6HTTPServer", _http_server_on(host)):
            super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{url_host(self.host)}:{port}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.received_from = metadata
        return super().recv_checkpoint(src_rank, metadata, step, timeout)


@contextlib.contextmanager
def manager_server_on(host: str) -> Iterator[None]:
    """While torchft's Manager is built: its ManagerServer binds `host` (at the port torchft asks for)."""
    real = torchft.manager.ManagerServer

    def bound(**kw: Any) -> Any:
        port = kw["bind"].rsplit(":", 1)[1]
        return real(**{**kw, "bind": f"{url_host(host)}:{port}"})

    with _replaced(torchft.manager, "ManagerServer", bound):
        yield

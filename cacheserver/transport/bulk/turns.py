"""Who serves a plain-TCP bulk connection's next request: this process, on the ready
loop, or a bulk worker (cacheserver.transport.bulk.readworker), in turn.

With `[bulk] workers > 1` a connection past its hello goes to a worker in turn (the
server keeps a turn of its own); the worker answers whole-hit reads and hands every
other request back over the connection's hand-back pair (delegation.py), and gives the
connection back when it only writes. A connection given back serves on here until its
last REDELEGATE_AFTER_READS requests were reads, then goes to a worker anew. The sealed
channel and the public scope always stay here. Served here, a connection lives on the
ready loop (cacheserver.transport.bulk.readyloop), or, without it, on its own thread.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable

from cacheserver.core.requests import RequestCore
from cacheserver.core.values import Verb
from cacheserver.transport.bulk.delegation import (
    CLOSED,
    GIVE_BACK,
    HAND_BACK,
    RATE_DRAWN,
    REDELEGATE_AFTER_READS,
    SERVED_ON,
)
from cacheserver.transport.bulk.handler import BulkHandler
from cacheserver.transport.bulk.readyloop import ReadyLoop
from cacheserver.transport.bulk.sealed import SealedHandler
from kvcommon import bulkwire as w
from policy.tickets import Grant
from policy.types import PUBLIC

log = logging.getLogger(__name__)
# Hands a connection past its hello to a bulk worker (True: to a worker, skipping the
# server's own turn): the server's end of the connection's hand-back pair, or None to
# serve it here.
DelegateTo = Callable[[socket.socket, Grant, bool], socket.socket | None]
# Serves one request of a connection (BulkServer._serve_one): False when it closes.
ServeOne = Callable[..., bool]
READS = (Verb.GET, Verb.LOOKUP)


class ServingTurns:
    def __init__(
        self,
        core: RequestCore,
        delegate_to: DelegateTo | None,
        serve_one: ServeOne,
        ready: ReadyLoop[BulkHandler] | None,
        close: Callable[[socket.socket], None],
        stopping: Callable[[], bool],
    ) -> None:
        """`delegate_to`: hands a connection to a bulk worker (None: no workers);
        `ready`: the ready loop (None: a thread per connection); `close` closes a
        connection and gives its slot back."""
        self._core = core
        self._delegate_to = delegate_to
        self._serve_one = serve_one
        self._ready = ready
        self._close = close
        self._stopping = stopping

    def serve(self, raw: socket.socket, handler: BulkHandler, to_a_worker: bool = False) -> bool:
        """A plain-TCP connection: here, or (with bulk workers, in turn) on a worker;
        one the worker gives back (it only wrote) goes to a worker again once it reads
        (`BulkServer._loop_serve_one`). Served here, it goes on the ready loop: True (the
        loop closes it, or hands it to a worker again)."""
        handler.given_back = False
        while (handback := self._delegate(raw, handler, to_a_worker)) is not None:
            if not self._serve_handed_back(handback, handler):
                return False
            handler.reads_in_a_row = 0
            if self._ready is not None:
                handler.given_back = True
                break
            if not self._serve_until_reads(handler):
                return False
            to_a_worker = True
        if self._ready is not None:
            sealed = isinstance(handler, SealedHandler)
            self._ready.adopt(
                raw, handler, lambda: self._leave_loop(raw, handler), peekable=not sealed
            )
            return True
        while self._serve_one(handler):
            pass
        return False

    def _leave_loop(self, raw: socket.socket, handler: BulkHandler) -> None:
        """A connection leaves the ready loop: closed, or (given back, it reads again)
        handed to a bulk worker on a thread of its own, as a new connection is."""
        reads_again = handler.given_back and handler.reads_in_a_row >= REDELEGATE_AFTER_READS
        if not reads_again or self._stopping():
            self._close(raw)
            return

        def redelegate() -> None:
            adopted = False
            try:
                adopted = self.serve(raw, handler, to_a_worker=True)
            except (OSError, w.ConnectionClosed, ssl.SSLError):
                pass  # the peer went, or a transfer ran out of time: it closes, as ever
            except Exception:
                log.exception("bulk connection failed")
            finally:
                if not adopted:
                    self._close(raw)

        threading.Thread(target=redelegate, name="kvshare-bulk-conn", daemon=True).start()

    def _serve_until_reads(self, handler: BulkHandler) -> bool:
        """Serve a connection a worker gave back until its last REDELEGATE_AFTER_READS
        requests were reads (True); False when it closes. (Without the ready loop.)"""
        while self._serve_one(handler):
            if reads_again(handler):
                return True
        return False

    def _delegate(
        self, raw: socket.socket, handler: BulkHandler, to_a_worker: bool = False
    ) -> socket.socket | None:
        """Hand a plain-TCP connection to a bulk worker, in turn (cacheserver.transport.bulk
        .processes; `to_a_worker`: skipping the server's own turn): the server's end of its
        hand-back pair, or None to serve it here."""
        grant = handler.grant
        if self._delegate_to is None or grant.channel_secret or grant.tenant == PUBLIC:
            return None  # the sealed channel and the public scope stay in the server
        return self._delegate_to(raw, grant, to_a_worker)

    def _serve_handed_back(self, handback: socket.socket, handler: BulkHandler) -> bool:
        """A delegated connection: serve each request its worker hands back, on this
        process's own descriptor of the connection, until the worker lets it go. True:
        the worker gave the connection back (GIVE_BACK), and it serves on here."""
        with handback:
            while (message := handback.recv(8))[:1] in (HAND_BACK, GIVE_BACK):
                serves_on = self._serve_one(handler, rate_drawn=message[1:2] == RATE_DRAWN)
                if message[:1] == GIVE_BACK:
                    return serves_on
                if handler.last_verb in READS:
                    self._core.read_handed_back()
                handback.sendall(SERVED_ON if serves_on else CLOSED)
                if not serves_on:
                    return False
        return False


def reads_again(handler: BulkHandler) -> bool:
    """After a request of a connection a bulk worker gave back: whether its last
    REDELEGATE_AFTER_READS requests were reads (it goes to a worker again)."""
    handler.reads_in_a_row = handler.reads_in_a_row + 1 if handler.last_verb in READS else 0
    return handler.reads_in_a_row >= REDELEGATE_AFTER_READS

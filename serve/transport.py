"""uvicorn's protocols as ``metronome-serve`` runs them: its HTTP protocol (httptools) and its sans-I/O WebSocket
protocol (``websockets``), each with what a server facing hostile clients needs and uvicorn does not do.

* **Bytes after the upgrade request.** A client may send its first frames in the same TCP write as the upgrade
  request; uvicorn's HTTP protocol hands the WebSocket protocol the request alone and drops the rest
  (:class:`HttpProtocol` passes it on), so those frames are answered or counted like any other.
* **Slow headers.** A request whose headers are not complete within :data:`HEADERS_TIMEOUT_S` (a slowloris
  client, a connection that never sends one) is closed.
* **Invalid UTF-8 in a text frame.** The socket closes with 1007, as uvicorn does, but the server logs one line
  (uvicorn logs a traceback per message, which a client can make it write as often as it likes).
* **A client that does not read.** The kernel's send buffer of a WebSocket is held to :data:`SEND_BUFFER_BYTES`
  (Linux's own grows to megabytes, so a client that stops reading would be seen only megabytes later), and the
  app can close a socket at once (:meth:`WebSocketProtocol.kick`): a close frame, then the connection is reset if
  the client has not closed it within :data:`KICK_GRACE_S` (a polite close waits on a client that never reads).
  The app reaches the protocol through the scope (:data:`SCOPE_KEY`).
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from metronome.serve.app import SCOPE_KEY

log = logging.getLogger("metronome.serve")
SEND_BUFFER_BYTES = 64 * 1024  # SO_SNDBUF of a WebSocket (Linux doubles it), and its transport's high-water mark
HEADERS_TIMEOUT_S = 10.0  # a request's headers, from the connection (or its first byte): else it is closed
KICK_GRACE_S = 1.0  # a kicked client's time to close after the close frame, before its connection is reset
PING_S = 20.0  # a ping every PING_S; a client that has not answered one within PING_S is not reading (uvicorn's timing)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, except that the bytes after an upgrade request go to the WebSocket, and a
    request's headers must be complete within :attr:`headers_timeout_s` of the connection (or of the request's
    first byte, on a kept-alive one), else the connection is closed (uvicorn waits for them for ever)."""

    headers_timeout_s = HEADERS_TIMEOUT_S
    _headers_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_headers_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._headers_timer is None:
            self._start_headers_timer()

    def on_headers_complete(self) -> None:
        self._stop_headers_timer()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._stop_headers_timer()
        super().connection_lost(exc)

    def _start_headers_timer(self) -> None:
        self._headers_timer = self.loop.call_later(self.headers_timeout_s, self._headers_late)

    def _stop_headers_timer(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if not self.transport.is_closing():
            c = self.client
            log.warning("%s: no complete request headers within %g s: closed",
                        f"{c[0]}:{c[1]}" if c else "a client", self.headers_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade as exc:
            if not self._should_upgrade():
                self._unsupported_upgrade_warning()
                return
            self.handle_websocket_upgrade()
            rest = data[exc.args[0]:]  # (httptools: the offset of the upgraded protocol's first byte)
            if rest:
                self.transport.get_protocol().data_received(rest)


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, with the changes of this module."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)  # (the app's sends wait past it)

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope[SCOPE_KEY] = self

    def kick(self, code: int, reason: str = "") -> None:
        """Close now, whatever waits to be sent: the close frame goes out behind it, the app hears the disconnect
        at once, and the connection is reset unless the client closed it within :data:`KICK_GRACE_S`."""
        if self.disconnected:
            return
        if not self.close_sent and self.handshake_complete and self.initial_response is None:
            self.conn.send_close(code, reason)
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
            self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
            self.writable.set()  # (a send waiting on a full buffer goes on, and finds the socket closed)
        self.loop.call_later(KICK_GRACE_S, self._reset)

    def keepalive_timeout(self) -> None:
        """A ping went unanswered for ``PING_S``: the client reads nothing (a pong needs a read). uvicorn would
        fail the connection with 1011 behind the app's back, and the session's accounts would call it a client
        that left; it is closed instead as any client that does not read (``on_unresponsive``: the app's
        ``not_reading`` limit, 1008), and what it was not given is counted ``undelivered``."""
        self.pong_timer = None
        self.pending_ping_payload = None
        if self.close_sent or self.transport.is_closing():
            return
        log.warning("%s: no answer to a ping in %g s: closed with 1008 (not_reading)", _peer(self), self.ping_timeout)
        if self.on_unresponsive is not None:
            self.on_unresponsive("not_reading")
        else:
            self.kick(1008, "not_reading")

    on_unresponsive = None  # set by the app once the session is accepted: called with the limit's name

    def unsent_bytes(self) -> int:
        """Bytes written to this socket that its client has not acknowledged: the transport's buffer and the
        kernel's send queue (unsent or unacknowledged, Linux's SIOCOUTQ); 0 once it is closed."""
        if self.disconnected:
            return 0
        n = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            except OSError:  # (not a TCP socket on Linux: the transport's buffer is what is known)
                pass
        return n

    def _reset(self) -> None:
        if not self.disconnected:
            self.transport.abort()

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            try:
                data.decode()
            except UnicodeDecodeError as exc:
                self.frames = []
                log.warning("%s: a text frame of invalid UTF-8 (%s): closed with 1007", _peer(self), exc.reason)
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()


def _peer(protocol) -> str:
    c = protocol.client
    return f"{c[0]}:{c[1]}" if c else "a client"

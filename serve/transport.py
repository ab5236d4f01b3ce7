"""uvicorn's protocols as ``metronome-serve`` runs them: its HTTP protocol (httptools) and its sans-I/O WebSocket
protocol (``websockets``), each with what a server facing hostile clients needs and uvicorn does not do.

* **Bytes after the upgrade request.** A client may send its first frames in the same TCP write as the upgrade
  request; uvicorn's HTTP protocol hands the WebSocket protocol the request alone and drops the rest
  (:class:`HttpProtocol` passes it on), so those frames are answered or counted like any other.
* **Invalid UTF-8 in a text frame.** The socket closes with 1007, as uvicorn does, but the server logs one line
  (uvicorn logs a traceback per message, which a client can make it write as often as it likes).
"""

from __future__ import annotations

import logging

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger("metronome.serve")


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, except that the bytes after an upgrade request go to the WebSocket."""

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

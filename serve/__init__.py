"""``metronome.serve``: ``metronome-serve``, real-time sessions over WebSocket admitted by the latency signal.

* ``gateway`` :class:`~metronome.serve.gateway.Gateway`: the live driver's front end (the core's, the simulator's
  own) on its own thread, serving sessions that arrive over the network; per-client queues and accounts.
* ``app``     the FastAPI app: the protocol of docs/serve.md, the upgrade's admission, ``/health``, ``/ready``,
  ``/metrics``, the drain.
* ``transport`` uvicorn's protocols as the server runs them: bytes after the upgrade request kept, a bounded send
  buffer, a socket closed at once when its client passes a limit.

The CLI is :mod:`metronome.cli.serve_cli`.
"""

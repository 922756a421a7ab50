"""TCP transport: authenticated, framed, timed, full-duplex channels between ranks.

- `endpoints.connect(host, port, identity, secret, ...)` dials with retry and backoff and runs the
  HMAC handshake; `endpoints.Listener(host, port, identity, secret).accept(expect_ranks)` accepts.
  Both return a `channel.Channel`, the point-to-point API (`send_array` / `recv_array`).
- `handshake.Identity` is what a rank claims (cluster id, rank, world size, wire dtype, model
  fingerprint, role); the secret binds it.
- `socketio` holds the timed non-blocking I/O and the full-duplex `Duplex` (a sender thread
  drains large sends while the caller receives).
Errors: every failure is a `socketio.TransportError` (PeerClosedError, PeerTimeoutError,
handshake.AuthError / ClaimMismatchError, endpoints.ConnectTimeoutError, ...) or, for malformed
frames, a `tandem.wire.frame.FrameError`.
"""

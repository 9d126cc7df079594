"""``StateTransport``: how a recovering replica group copies the live state from a peer.

It takes the place of torchft's HTTP checkpoint transport, which unpickles whatever a peer
answers: any host that could pose as a replica group ran code in the worker. Here every rank
serves its state over HTTP on the configured address, in ``wire``'s format, which decodes
into tensors and plain containers only. With ``DREAM_TRAINER_FT_SECRET`` set (the same
value on every group) both directions are authenticated with HMAC-SHA256: a request must
carry a token for the exact URL it asks for, and an answer is parsed only once its
signature checks out.
"""

from __future__ import annotations

import hmac
import http.client
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from hashlib import sha256
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from dream_trainer.errors import RecoveryError
from dream_trainer.ft.listeners import family_of, url_host
from dream_trainer.ft.wire import Encoded, decode, encode

logger = logging.getLogger(__name__)

SECRET_ENV = "DREAM_TRAINER_FT_SECRET"
"""The environment variable holding the secret shared by every replica group (optional)."""
MIN_SECRET_LENGTH = 16
TOKEN_HEADER = "X-Dream-Trainer-Token"
_PATH = "/state/"
_MAC_SIZE = sha256().digest_size
_CHUNK = 2**20


def secret_from_env() -> bytes | None:
    """The shared secret from ``DREAM_TRAINER_FT_SECRET``, or None when it is not set.

    Raises:
        ValueError: if it is set but shorter than ``MIN_SECRET_LENGTH`` characters (the
            message never shows it).
    """
    value = os.environ.get(SECRET_ENV)
    if value is None:
        return None
    if len(value) < MIN_SECRET_LENGTH:
        raise ValueError(
            f"{SECRET_ENV} is set but has {len(value)} characters: use at least "
            f"{MIN_SECRET_LENGTH} random ones (python -c 'import secrets; "
            "print(secrets.token_hex(32))'), the same on every replica group, or unset it")
    return value.encode("utf-8")


class StateTransport:
    """torchft's ``CheckpointTransport`` interface over HTTP, without pickle.

    ``send_checkpoint`` makes the state available to peers until ``disallow_checkpoint``;
    ``recv_checkpoint`` fetches a peer's, refuses it unless it decodes (and, with a secret,
    authenticates), then hands it to ``check`` before torchft applies it. A request that
    arrives before the state is available waits for it, up to ``timeout``.

    Args:
        bind: The address to listen on (port chosen by the system).
        advertise: The host peers are told to fetch from.
        timeout: Limit on a whole fetch, and on each wait of the server.
        secret: The shared secret, or None for none.
        check: Called with a received state and the step torchft asked for; raises
            ``RecoveryError`` (or ``ValueError``) if it is not plausible.
        max_bytes: The largest answer to accept, asked before each fetch.
    """

    def __init__(self, bind: str, advertise: str, timeout: timedelta, secret: bytes | None,
                 check: Callable[[Any, int], None], max_bytes: Callable[[], int]) -> None:
        self._timeout = timeout.total_seconds()
        self._secret, self._check, self._max_bytes = secret, check, max_bytes
        self._changed = threading.Condition()
        # Bumped whenever the served state is replaced or withdrawn: a response whose
        # generation moved while it was written is cut short, since its tensors may have
        # changed under it.
        self._generation = 0
        self._serving: tuple[int, Encoded] | None = None
        self._server = _server(bind, self)
        self._url_base = f"http://{url_host(advertise)}:{self._server.server_address[1]}{_PATH}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="dream_trainer_ft_state", daemon=True)
        self._thread.start()

    # -- torchft's CheckpointTransport ------------------------------------------------------
    def metadata(self) -> str:
        """Where peers fetch this rank's state: ``http://HOST:PORT/state/``."""
        return self._url_base

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        """Serve ``state_dict`` as the state of ``step`` until ``disallow_checkpoint``."""
        encoded = encode(state_dict)
        with self._changed:
            self._generation += 1
            self._serving = (step, encoded)
            self._changed.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving: after this the state may change (responses still being written
        are cut short)."""
        with self._changed:
            self._generation += 1
            self._serving = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        """Fetch, authenticate, decode and check the state of ``step`` from ``metadata``.

        Raises:
            RecoveryError: naming the peer's URL and why its answer was refused.
        """
        url = f"{metadata}{step}"
        try:
            host, port = _peer(metadata)
            state = decode(self._fetch(host, port, url, timeout.total_seconds()), url)
            self._check(state, step)
        # Whatever goes wrong with a peer's answer is refused the same way: torchft reports
        # it and the step does not commit; nothing of the answer has been applied.
        except Exception as exc:
            raise RecoveryError(f"refused the state offered by the peer at {url}: "
                                f"{type(exc).__name__}: {exc}") from exc
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and close the listening socket."""
        self.disallow_checkpoint()
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    # -- fetching ----------------------------------------------------------------------------
    def _fetch(self, host: str, port: int, url: str, timeout: float) -> memoryview:
        deadline = time.monotonic() + timeout
        limit = self._max_bytes()
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            headers = {} if self._secret is None else {
                TOKEN_HEADER: request_token(self._secret, url)}
            connection.request("GET", urlsplit(url).path, headers=headers)
            response = connection.getresponse()
            if response.status != 200:
                reason = response.read(4096).decode("utf-8", "replace").strip()
                hint = (f": set the same {SECRET_ENV} on every replica group"
                        if response.status == 403 else "")
                raise ValueError(f"it answered HTTP {response.status} ({reason[:300]}){hint}")
            size = _content_length(response.getheader("Content-Length"))
            if size > limit:
                raise ValueError(f"it announced {size} bytes, more than the {limit} a state "
                                 "of this group's models can plausibly hold")
            body = bytearray(size)
            view, received = memoryview(body), 0
            while received < size:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"it sent {received} of {size} bytes within the "
                                       f"timeout of {timeout:g}s")
                count = response.readinto(view[received:received + _CHUNK])
                if not count:
                    raise ValueError(f"it closed the connection after {received} of {size} "
                                     "bytes")
                received += count
        finally:
            connection.close()
        return self._authenticated(body, url)

    def _authenticated(self, body: bytearray, url: str) -> memoryview:
        """The payload of ``body``, once its signature is checked (with a secret)."""
        if self._secret is None:
            return memoryview(body)
        if len(body) < _MAC_SIZE:
            raise ValueError("its answer is too short to carry a signature")
        payload = memoryview(body)[:-_MAC_SIZE]
        mac = response_mac(self._secret, url)
        mac.update(payload)
        if not hmac.compare_digest(mac.digest(), bytes(body[-_MAC_SIZE:])):
            raise ValueError(f"its answer is not signed with this group's {SECRET_ENV}: set "
                             "the same secret on every replica group")
        return payload

    # -- serving -----------------------------------------------------------------------------
    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        """Answer one GET: the state of the step in the path, once it is served."""
        path = handler.path
        step_text = path.removeprefix(_PATH)
        if not (path.startswith(_PATH) and step_text.isascii() and step_text.isdigit()
                and len(step_text) <= 20):
            handler.send_error(404, f"this server only answers GET {_PATH}<step>")
            return
        url = f"{self._url_base}{step_text}"
        if self._secret is not None:
            token = handler.headers.get(TOKEN_HEADER, "")
            if not hmac.compare_digest(token.encode("ascii", "replace"),
                                       request_token(self._secret, url).encode("ascii")):
                handler.send_error(403, f"a request without a valid {SECRET_ENV} token")
                return
        step = int(step_text)
        with self._changed:
            ready = self._changed.wait_for(lambda: self._serving is not None, self._timeout)
            if not ready or self._serving is None:
                handler.send_error(503, f"no state served within {self._timeout:g}s")
                return
            served_step, encoded = self._serving
            generation = self._generation
        if served_step != step:
            handler.send_error(409, f"serving the state of step {served_step}, not {step}")
            return
        mac = None if self._secret is None else response_mac(self._secret, url)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length",
                            str(encoded.nbytes + (0 if mac is None else _MAC_SIZE)))
        handler.end_headers()
        for chunk in encoded.chunks():
            handler.wfile.write(chunk)
            if mac is not None:
                mac.update(chunk)
            if self._generation != generation:
                # The state may have changed while this chunk was written: end the response
                # short, so that the peer refuses it rather than apply a torn state.
                handler.close_connection = True
                return
        if mac is not None:
            handler.wfile.write(mac.digest())


def request_token(secret: bytes, url: str) -> str:
    """The token that lets a request fetch ``url`` (which names the server and the step,
    so that a token shown to one server is no use at another)."""
    return hmac.new(secret, b"dream_trainer ft request\0" + url.encode(), sha256).hexdigest()


def response_mac(secret: bytes, url: str) -> hmac.HMAC:
    """The running signature of the answer to ``url``, before its bytes are added."""
    return hmac.new(secret, b"dream_trainer ft response\0" + url.encode() + b"\0", sha256)


def _peer(metadata: str) -> tuple[str, int]:
    """The host and port of a peer's state server from the metadata it advertised.

    Raises:
        ValueError: if it is not ``http://HOST:PORT/state/`` (nothing else is fetched).
    """
    parts = urlsplit(metadata)
    if parts.scheme != "http" or not parts.hostname or parts.port is None \
            or parts.path != _PATH or parts.query or parts.fragment or parts.username:
        raise ValueError(f"it advertised {metadata[:200]!r}, not http://HOST:PORT{_PATH}")
    return parts.hostname, parts.port


def _content_length(value: str | None) -> int:
    if value is None or not (value.isascii() and value.isdigit()):
        raise ValueError(f"its answer has no valid Content-Length ({str(value)[:40]!r})")
    return int(value)


def _server(bind: str, transport: StateTransport) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        # A peer that stops reading or sending gives up its thread after this long.
        timeout = transport._timeout
        error_message_format = "%(message)s"
        error_content_type = "text/plain; charset=utf-8"

        def do_GET(self) -> None:
            try:
                transport._serve(self)
            except OSError as exc:
                logger.warning("the state server lost a peer mid-answer (%s): %s",
                               self.client_address[0], exc)
            except Exception:
                logger.exception("the state server failed to answer %s", self.client_address[0])
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("state server: " + format, *args)

    class Server(ThreadingHTTPServer):
        address_family = family_of(bind)
        daemon_threads = True

    return Server((bind, 0), Handler)

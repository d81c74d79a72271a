"""One way to send an answer: every response of the app passes ``SendPath``.

``SendPath`` is the app's outermost middleware of its own (``app.add_middleware``),
so every route's answer goes through it: operators, event streams, job results and
events, the registry, metrics, the API documents, error documents. It makes two
promises for every answer, whichever route wrote it:

* **held until written.** A body message larger than ``admission.SMALL_BYTES`` is held
  in the in-flight budget (``admission.Budget``) until the answer's last byte has been
  taken by the client, or the client is cut off. An answer's last message is sent as
  the body and then an empty closing message: the server sends that one only once the
  client has taken all but a little of what was written (the write buffer's low-water
  mark), so waiting for it is waiting for the client. Bytes the route holds on a
  ticket of its own (an operator's result, reserved before it ran) are told to the send
  path with ``cover``, and not counted twice; ``cover`` also hands the ticket over:
  it is released when the answer is done.
* **slow readers cut off.** A client that takes nothing for ``DXSERVE_WRITE_TIMEOUT``
  while its answer waits is disconnected by the connection's protocol
  (``protocol.py``, for both httptools and h11); the closing message then returns at
  once and everything held is given back.

The budget counts the answers being written (``Budget.sending``, the
``dxserve_answers_sending`` metric) so a test can see each answer wait for its client.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dxserve.server.admission import SMALL_BYTES, Budget, Ticket

#: the scope key under which a request's ``Sending`` is found
SCOPE_KEY = "dxserve.sending"


class Sending:
    """One answer on its way: the ``send`` every route's messages go through."""

    __slots__ = ("_send", "budget", "covered", "held", "open")

    def __init__(self, budget: Budget, send: Send) -> None:
        self.budget = budget
        self._send = send
        #: tickets the route holds this answer's bytes on (released when it is done)
        self.covered: list[Ticket] = []
        self.held = 0  # bytes this answer holds beyond what ``covered`` holds
        self.open = False  # started and not yet complete

    def cover(self, ticket: Ticket) -> None:
        """``ticket`` holds this answer's bytes: count no more than it holds, and release
        it once the answer is written (or its client is gone)."""
        self.covered.append(ticket)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if not self.open:
                self.open = True
                self.budget.sending += 1
                self.budget.answers += 1
            await self._send(message)
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        body = message.get("body", b"")
        size = len(body)
        if size <= SMALL_BYTES:  # not counted: the connection limits bound these
            await self._send(message)
            if not message.get("more_body", False):
                self.close()
            return
        # the bytes now on their way, beyond what the route's own tickets hold: the
        # ones before them were taken already (each send waits while the client is
        # behind), so this message is what waits in memory now
        self._hold(max(0, size - sum(t.held for t in self.covered)))
        if message.get("more_body", False):
            await self._send(message)
            return
        await self._send({"type": "http.response.body", "body": body, "more_body": True})
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        self.close()

    def _hold(self, nbytes: int) -> None:
        self.budget.hold_written(nbytes - self.held)
        self.held = nbytes

    def close(self) -> None:
        """The answer is written, or will never be: give back what it holds (again:
        nothing happens)."""
        if self.held:
            self.budget.hold_written(-self.held)
            self.held = 0
        covered, self.covered = self.covered, []
        for ticket in covered:
            ticket.release()
        if self.open:
            self.open = False
            self.budget.sending -= 1


class SendPath:
    """ASGI middleware: every answer of ``app`` through a ``Sending`` over ``budget``."""

    def __init__(self, app: ASGIApp, budget: Budget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sending = Sending(self.budget, send)
        scope[SCOPE_KEY] = sending
        try:
            await self.app(scope, receive, sending.send)
        finally:
            sending.close()


def sending_of(scope: Scope) -> Sending | None:
    """The request's ``Sending`` (None outside ``SendPath``: an app without it)."""
    return scope.get(SCOPE_KEY)


def cover(scope: Scope, ticket: Ticket) -> None:
    """Hand ``ticket`` to the request's send path (see ``Sending.cover``); without one,
    the caller keeps releasing it itself."""
    sending = scope.get(SCOPE_KEY)
    if sending is not None:
        sending.cover(ticket)

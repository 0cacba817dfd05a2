"""Which API process each request's outputs go to.

An engine serves every API process of a server (`--api-server-count`): requests come in on one
socket from all of them, each tagged with its sender; outputs go out on a ROUTER socket, one
message per API process that has deltas in a step (and to every one at each gauge refresh).
An API process announces itself with `ClientHello` on that socket before it sends requests.
"""

from __future__ import annotations

from collections import defaultdict

from fastdeploy.common.request import RequestDelta


class ClientRoutes:
    def __init__(self) -> None:
        self.clients: list[bytes] = []  # in the order they said hello
        self._owner: dict[str, bytes] = {}  # request id -> its API process

    def add_client(self, identity: bytes) -> None:
        if identity not in self.clients:
            self.clients.append(identity)

    def claim(self, request_id: str, client: bytes) -> bool:
        """Route `request_id`'s outputs to `client`; False where another request of that id is
        still open (its outputs must not be taken over)."""
        if request_id in self._owner:
            return False
        self._owner[request_id] = client
        return True

    def split(self, deltas: list[RequestDelta]) -> dict[bytes, list[RequestDelta]]:
        """Deltas per API process, in step order; a request is forgotten with its last delta."""
        out: dict[bytes, list[RequestDelta]] = defaultdict(list)
        for delta in deltas:
            owner = self._owner.get(delta.request_id)
            if owner is None:
                continue  # refused before it was claimed (routed by the caller) or already ended
            out[owner].append(delta)
            if delta.finish_reason is not None:
                del self._owner[delta.request_id]
        return out

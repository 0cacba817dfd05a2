"""The engine's check that the API server still runs: read at most once per interval, and a
process that exits is seen as gone after that interval."""

from __future__ import annotations

import subprocess
import sys
import time

from fastdeploy.common.ipc import PeerWatch


def test_a_peer_that_exits_is_seen_gone_once_the_interval_has_passed() -> None:
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = PeerWatch(peer.pid, interval_s=0.3)
        assert watch.alive()
        peer.kill()
        peer.wait(timeout=10)
        assert watch.alive()  # asked again within the interval: the last reading
        time.sleep(0.35)
        assert not watch.alive()
    finally:
        peer.kill()
        peer.wait(timeout=10)

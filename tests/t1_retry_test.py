"""The one retry policy (mtcfs.base.retry) and the peer client's classification of gRPC
errors: UNAVAILABLE and DEADLINE_EXCEEDED are retried, every other status surfaces at once.
No server: the RPC is a function that raises."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from mtcfs.base.retry import RetryPolicy, is_retryable
from mtcfs.tiers.peer.client import PeerClient, is_transient
from mtcfs.tiers.peer.errors import PeerError, PeerUnavailable


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "fake"


FAST = RetryPolicy(max_attempts=4, base_delay=0.001, max_delay=0.002)


def client(policy: RetryPolicy = FAST, stop: threading.Event | None = None) -> PeerClient:
    return PeerClient("127.0.0.1:1", "job", 0, retry=policy, stop=stop, rng=random.Random(1))


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_peer_retry_classification(code: grpc.StatusCode) -> None:
    transient = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert is_transient(FakeRpcError(code)) is transient
    calls: list[int] = []

    def rpc() -> str:
        calls.append(1)
        raise FakeRpcError(code)

    with client() as c:
        with pytest.raises(PeerError) as info:
            c._call(rpc, "HasChunks")
        assert isinstance(info.value, PeerUnavailable) is transient
        assert info.value.code == code
        assert len(calls) == (4 if transient else 1)
        stats = c.stats()
        assert stats["calls"] == len(calls) and stats["failures"] == 1
        assert stats["retries"] == len(calls) - 1


def test_peer_retry_recovers_and_other_errors_are_not_retried() -> None:
    assert not is_transient(ValueError("x")) and not is_transient(grpc.RpcError())
    seq = [FakeRpcError(grpc.StatusCode.UNAVAILABLE),
           FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED)]

    def rpc() -> str:
        if seq:
            raise seq.pop(0)
        return "ok"

    with client() as c:
        assert c._call(rpc, "HasChunks") == "ok"
        assert c.stats()["calls"] == 3 and c.stats()["retries"] == 2
        with pytest.raises(ValueError):  # not an RPC error: surfaces as itself, no retry
            c._call(lambda: (_ for _ in ()).throw(ValueError("bug")), "HasChunks")
    stop = threading.Event()
    stop.set()
    with client(RetryPolicy(), stop) as c:  # stop set: one attempt, no wait
        with pytest.raises(PeerUnavailable):
            c._call(lambda: (_ for _ in ()).throw(
                FakeRpcError(grpc.StatusCode.UNAVAILABLE)), "HasChunks")
        assert c.stats()["calls"] == 1


def test_base_policy_retryable_forms() -> None:
    assert is_retryable(KeyError("k"), (LookupError,))
    assert not is_retryable(ValueError(), (LookupError,))
    assert is_retryable(ValueError("again"), lambda e: "again" in str(e))
    waits: list[float] = []
    n = [0]

    def flaky() -> int:
        n[0] += 1
        if n[0] < 3:
            raise OSError("hiccup")
        return n[0]

    assert RetryPolicy(base_delay=0.1, max_delay=1.0).call(
        flaky, retryable=(OSError,), sleep=waits.append) == 3
    assert len(waits) == 2 and all(0 <= w <= 1.0 for w in waits)
    with pytest.raises(OSError):  # the base policy retries nothing unless told
        n[0] = 0
        RetryPolicy().call(flaky, sleep=waits.append)
    assert n[0] == 1
    with pytest.raises(OSError) as info:
        n[0] = -10
        RetryPolicy(max_attempts=2, base_delay=0.0, max_delay=0.0).call(
            flaky, retryable=(OSError,), sleep=waits.append)
    assert "2 attempts made" in "".join(info.value.__notes__)

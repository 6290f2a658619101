"""A recording stand-in for what :class:`mtcfs.core.verifier.Verifier` calls on the core
(``verifier.Host``): the verifier's unit tests (t3_verifier_test, t3_hash_threads_test)."""

from __future__ import annotations

import os

from mtcfs.core.model import Version


class VerifierHost:
    """The calls Verifier makes on the core (verifier.Host), recorded."""

    def __init__(self, tmp_path) -> None:
        self.dir = tmp_path
        self.versions: dict[int, Version] = {}
        self.corrupt: list[tuple[int, int, str]] = []
        self.errors: list[str] = []
        self.vstore = self  # verifier.Host.vstore: release(v)

    def open_data(self, vid: int) -> int:
        return os.open(str(self.dir / f"v{vid}"), os.O_RDWR | os.O_CREAT, 0o600)

    def mark_corrupt(self, v: Version, idx: int, found_by: str) -> None:
        v.missing.add(idx)  # as the core does, so that a verdict is acted on once
        self.corrupt.append((v.vid, idx, found_by))

    def release(self, v: Version) -> None:
        pass

    def report_error(self, msg: str) -> None:
        self.errors.append(msg)

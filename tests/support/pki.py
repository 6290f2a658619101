"""The job CA of tests: :class:`mtcfs.base.pki.JobCa` (kept here under its test name)."""

from mtcfs.base.pki import Issued, JobCa

TestCa = JobCa
TestCa.__test__ = False  # type: ignore[attr-defined]  # not a pytest class

__all__ = ["Issued", "TestCa"]

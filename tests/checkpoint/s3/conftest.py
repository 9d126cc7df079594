"""One moto S3 server per test process (tests/helpers/s3.py): a real HTTP endpoint on
127.0.0.1 that the library reaches through the ``AWS_*`` environment, as child processes do."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.s3 import S3Server, s3_server


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture
def s3_url(s3: S3Server, request: pytest.FixtureRequest) -> str:
    """A prefix of the bucket of this test's own, ``s3://<bucket>/<test name>``."""
    return s3.url(request.node.name.replace("[", "-").replace("]", ""))

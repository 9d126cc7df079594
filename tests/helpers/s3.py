"""moto's S3 server, a real S3-compatible HTTP endpoint on 127.0.0.1, for the object-storage
tests: no client is mocked; the library reaches it through the ``AWS_*`` environment."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.helpers.launch import free_port

BUCKET = "dream-test"

# What boto3, s3fs and child processes read: fake credentials (moto accepts any) and the
# endpoint. AWS_EC2_METADATA_DISABLED keeps botocore from probing 169.254.169.254, and two
# attempts per request (botocore's default is five, with backoff) make a stopped server fail
# a request in seconds.
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_MAX_ATTEMPTS": "2"}


@dataclass
class S3Server:
    """A running moto server and the bucket it was started with."""

    server: Any
    port: int
    bucket: str = BUCKET

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, *parts: str) -> str:
        """``s3://<bucket>/<parts joined by />``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` in the bucket, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        """Start it again on the same port (moto keeps its buckets in this process)."""
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()


@contextmanager
def s3_server(bucket: str = BUCKET) -> Iterator[S3Server]:
    """Start moto's server on a free port, create ``bucket``, and point ``os.environ`` (so
    every child process too) at it; restore the environment afterwards."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # Werkzeug logs every request otherwise.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    saved = {name: os.environ.get(name) for name in [*_CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update({**_CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    running = S3Server(server, port, bucket)
    try:
        running.client().create_bucket(Bucket=bucket)
        yield running
    finally:
        running.server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def lock_contender(tasks: Any, results: Any, barrier: Any) -> None:
    """A run racing for object-store locks, in a process of its own (``tests/checkpoint/s3/
    test_lock_race.py``): per URL from ``tasks`` (None ends it), wait on ``barrier`` with the
    other contender, try ``ObjectLock(...).acquire()``, put ``(pid, "held" or the error)``
    on ``results``, and release only after both have tried (an earlier release would let
    the other take the lock legitimately, a second winner in sequence, not in a race)."""
    from dream_trainer.checkpoint.object_store import ObjectLock
    from dream_trainer.checkpoint.storage import location, storage_for
    from dream_trainer.errors import CheckpointError

    while (url := tasks.get()) is not None:
        root = location(url)
        lock = ObjectLock(storage_for(root), root)  # type: ignore[arg-type]
        barrier.wait()
        try:
            lock.acquire()
            outcome = "held"
        except CheckpointError as exc:
            outcome = str(exc)
        results.put((os.getpid(), outcome))
        barrier.wait()
        lock.release()

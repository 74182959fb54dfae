"""S3 request helpers of the S3 tier: bucket setup and listing, lifecycle,
body reading, error classification, outage pauses, bounded-rate warnings,
settings checks.

None of this knows the tier's index or capacity (``tiers/s3.py``); every
function takes a boto3 S3 client and raises botocore's errors unless it says
otherwise.
"""
from __future__ import annotations

import io
import logging
import re
import threading
import time
from typing import Iterator

import torch
import urllib3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError, ConnectionClosedError

from tiers.types import BlockHash, ConfigError, TierUnavailableError

MIB = 1 << 20
MIN_PART = 5 * MIB  # S3's smallest multipart part
MISSING = {"404", "NoSuchKey", "NotFound"}
NO_NS = "0" * 32  # namespace of objects too short to carry a header (never written by the store)
DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 limit)
AUTH = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"}


class Throttled:
    """Emits at most one warning per `every_s` on `log`, counting the rest."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = log, every_s
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def warn(self, msg: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._suppressed += 1
                return
            skipped, self._suppressed, self._next = self._suppressed, 0, now + self.every_s
        self.log.warning(msg + (f" (+{skipped} similar suppressed)" if skipped else ""), *args)


DROPS_TO_TRIP = 3


class Outage:
    """When an S3 that failed as if down is left alone: for `retry_after_s`
    after such a failure, doubled (up to 8x) when S3 answered nothing since
    the last pause began, so an outage costs callers misses, not waits. An
    S3 that hangs answers nothing however long each request takes to fail;
    failures between answers start over at `retry_after_s`."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._pause = retry_after_s  # the current pause (doubles, up to 8x)
        self._answered = True  # S3 answered a request since the last pause began
        self._dropped = 0  # connections dropped mid-request since S3 last answered

    def answered(self) -> None:
        """A request got an answer from S3 (a 404 counts)."""
        self._answered, self._dropped = True, 0

    def dropped(self) -> None:
        """A connection dropped mid-request (`transient`): one is a miss, but
        DROPS_TO_TRIP of them with no answer between is an outage (an endpoint
        that accepts connections and closes them)."""
        self._dropped += 1
        if self._dropped >= DROPS_TO_TRIP:
            self.trip()

    def over(self) -> bool:
        """False while S3 is being left alone."""
        return time.monotonic() >= self._down_until

    def confirmed(self) -> bool:
        """S3 answered a request since the last pause began (or never paused)."""
        return self._answered

    def ended(self) -> float:
        """When the last pause ended (or ends): time.monotonic()'s clock."""
        return self._down_until

    def trip(self) -> None:
        """A failure that looks like an outage: leave S3 alone for a while."""
        now = time.monotonic()
        if now < self._down_until:  # another request of the same burst
            return
        again = not self._answered
        self._pause = min(2 * self._pause, 8 * self.retry_after_s) if again else self.retry_after_s
        self._down_until, self._answered, self._dropped = now + self._pause, False, 0


def error_code(e: Exception) -> str:
    """S3's error code (or HTTP status) of a ClientError; "" for any other error."""
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        return str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def transient(e: Exception) -> bool:
    """A connection dropped in the middle of one request: one load's miss,
    not an outage (refused connections and timeouts are)."""
    return isinstance(e, (ConnectionClosedError, urllib3.exceptions.ProtocolError)) or type(e) is OSError


def looks_down(e: Exception) -> bool:
    """Whether a failure says S3 is unreachable or overloaded (transport
    failure, an HTTP 5xx whatever its code says, throttling) rather than
    wrong for one key."""
    if not isinstance(e, ClientError):
        return True
    status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    code = error_code(e)
    return status.startswith("5") or status == "429" or code.startswith("5") or code in ("SlowDown", "ServiceUnavailable")


def client(session, attempts: int, *, endpoint_url: str | None, access_key: str | None, secret_key: str | None,
           region: str, addressing_style: str, connections: int, connect_timeout: float, read_timeout: float):
    """A boto3 S3 client of `session` making up to `attempts` tries per request
    (botocore's standard retries). Per-request checksums only when required:
    objects carry their own, verified end to end."""
    cfg = BotoConfig(region_name=region, s3={"addressing_style": addressing_style},
                     connect_timeout=connect_timeout, read_timeout=read_timeout,
                     retries={"mode": "standard", "total_max_attempts": attempts}, max_pool_connections=connections,
                     request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return session.client("s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
                          aws_secret_access_key=secret_key, config=cfg)


def ensure_bucket(client, bucket: str) -> None:
    """Create `bucket` (in the client's region) unless it exists."""
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as e:
        if error_code(e) not in MISSING and error_code(e) != "NoSuchBucket":
            raise
        region = client.meta.region_name
        where = {} if region == "us-east-1" else {
            "CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            client.create_bucket(Bucket=bucket, **where)
        except ClientError as e2:
            if error_code(e2) != "BucketAlreadyOwnedByYou":  # another node won the race
                raise


def list_blocks(client, bucket: str, prefix: str) -> Iterator[tuple[BlockHash, int, int, str]]:
    """(hash, size, last-modified ns, namespace hex) of every block key
    ``<prefix>/<ns>/<hh>/<hex>`` in the bucket, page by page; other keys under
    the prefix (quarantine, sessions) are skipped."""
    pattern = re.compile(re.escape(prefix) + r"/([0-9a-f]{32})/([0-9a-f]{2})/([0-9a-f]{32})")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    for page in pages:
        for o in page.get("Contents", ()):
            m = pattern.fullmatch(o["Key"])
            if m and m.group(3).startswith(m.group(2)):
                mtime = int(o["LastModified"].timestamp() * 1e9)
                yield BlockHash(bytes.fromhex(m.group(3))), o["Size"], mtime, m.group(1)


def namespace_of(obj: torch.Tensor) -> str:
    """Namespace fingerprint (hex) from a block object's header, bytes 8..24."""
    return bytes(obj[8:24].tolist()).hex() if obj.numel() >= 24 else NO_NS


def copy_aside(client, bucket: str, key: str, dst: str) -> None:
    """Copy object `key` to `dst`-<ns timestamp> (for inspection)."""
    client.copy_object(Bucket=bucket, Key=f"{dst}-{time.time_ns()}", CopySource={"Bucket": bucket, "Key": key})


def upload(client, bucket: str, key: str, data: bytes, transfer: TransferConfig) -> None:
    """One object: a single PUT, or a multipart upload from `transfer`'s threshold up."""
    if len(data) >= transfer.multipart_threshold:
        client.upload_fileobj(io.BytesIO(data), bucket, key, Config=transfer)
    else:
        client.put_object(Bucket=bucket, Key=key, Body=data)


def delete_keys(client, bucket: str, keys: list[str]) -> list[dict]:
    """Delete up to DELETE_BATCH keys in one request; the per-key errors
    other than "missing" (already gone is deleted)."""
    resp = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
    return [err for err in resp.get("Errors", ()) if err.get("Code") not in MISSING]


def set_expiration(client, bucket: str, prefix: str, days: int) -> None:
    """Install (or replace) a lifecycle rule expiring objects under `prefix`
    `days` after they were written; other rules are kept. Raises ConfigError
    for `days` <= 0, TierUnavailableError if S3 refuses."""
    if days <= 0:
        raise ConfigError(f"s3 tier: expiration days must be positive, got {days}")
    rule_id = f"tierkv-expire-{prefix}"
    try:
        try:
            rules = client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
        except ClientError as e:
            if error_code(e) != "NoSuchLifecycleConfiguration":
                raise
            rules = []
        rules = [r for r in rules if r.get("ID") != rule_id] + [{
            "ID": rule_id, "Filter": {"Prefix": prefix + "/"}, "Status": "Enabled",
            "Expiration": {"Days": days}}]
        client.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
    except (BotoCoreError, ClientError) as e:
        raise TierUnavailableError(f"s3 tier: cannot set lifecycle on {bucket}: {e}") from None


def read_body(resp: dict, expect: int = 0) -> torch.Tensor | None:
    """The response body read straight into a preallocated tensor; OSError if
    the stream ends before Content-Length bytes. None, without reading it,
    when `expect` (bytes) is given and Content-Length is another size."""
    n = resp["ContentLength"]
    if expect and n != expect:
        resp["Body"].close()
        return None
    buf = torch.empty(n, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    body = resp["Body"]
    raw = body._raw_stream  # the urllib3 response: readinto, no bytes object of the whole body
    try:
        got = 0
        while got < n:
            k = raw.readinto(view[got:])
            if not k:
                raise OSError(f"body ended after {got} of {n} bytes")
            got += k
    finally:
        body.close()
    return buf


def validate(bucket: str, prefix: str, addressing_style: str, max_concurrency: int,
             multipart_threshold: int, connect_timeout: float, read_timeout: float,
             retries: int, capacity_bytes: int) -> None:
    """S3Tier's constructor arguments, checked before any request (ConfigError names the bad one)."""
    checks = [
        (bool(re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket or "")), f"bucket name {bucket!r}"),
        (bool(prefix) and not prefix.startswith("/") and not prefix.endswith("/"), f"prefix {prefix!r}"),
        (addressing_style in ("path", "virtual", "auto"), f"addressing_style {addressing_style!r}"),
        (max_concurrency >= 1, f"max_concurrency {max_concurrency}"),
        (multipart_threshold >= MIN_PART, f"multipart_threshold {multipart_threshold} (S3 needs >= 5 MiB)"),
        (connect_timeout > 0 and read_timeout > 0, f"timeouts {connect_timeout}/{read_timeout}"),
        (retries >= 0, f"retries {retries}"),
        (capacity_bytes > 0, f"capacity_bytes {capacity_bytes}"),
    ]
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"s3 tier: invalid {what}")

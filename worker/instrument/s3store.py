"""The S3-compatible backend of the observation store (AWS S3, MinIO, Ceph RGW).

Owns talking to a bucket through boto3: write-once puts with ``If-None-Match: *``,
overwrites, reads and listings under a key prefix, and the mapping of every boto3 or
service failure to ``StoreUnavailable`` without a secret in its message. Imported by
``worker.instrument.store.open_store`` only for an ``s3://`` URL (and by the instrument's
eager load, which is why boto3 itself is imported only when a store is opened: a fleet
on a file store never loads it, a tenth of a second and more at every start).

Trusts: the settings it is given (endpoint, region, addressing style), the standard
AWS credential chain (read by boto3, never stored, logged or put in a message), and
the service to answer 412 to a conditional create of an existing key.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from worker.instrument.store import ObservationStore, StoreUnavailable, redact_url

if TYPE_CHECKING:
    from botocore.exceptions import BotoCoreError, ClientError

# A 409 ConditionalRequestConflict means another conditional write of the same key
# was in flight. AWS asks callers to retry: the retry settles it as 412 (the other
# writer won) or 200 (it failed and we wrote). Answering "exists" without that
# evidence could lose the only copy of an observation.
_CONFLICT_ATTEMPTS = 4
_CONFLICT_BACKOFF_SECONDS = 0.2


class S3Config(Protocol):
    """Where an S3-compatible store answers (the fleet's settings provide these)."""

    s3_endpoint_url: str | None
    s3_region: str | None
    s3_path_style: bool


class S3Store(ObservationStore):
    """A bucket and optional key prefix on any S3-compatible service."""

    def __init__(self, url: str, bucket: str, prefix: str, settings: S3Config) -> None:
        import boto3
        from botocore import exceptions
        from botocore.config import Config

        self.errors = exceptions  # botocore's exception classes, caught below
        self.url = url
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = settings.s3_endpoint_url
        config = Config(
            connect_timeout=3,
            read_timeout=15,
            # The fleet retries whole jobs; here a few quick attempts ride out a blip
            # without holding a worker for minutes.
            retries={"mode": "standard", "max_attempts": 3},
            s3={"addressing_style": "path" if settings.s3_path_style else "auto"},
            # boto3 >= 1.36 adds CRC checksums to every upload by default, which
            # older MinIO and Ceph RGW reject; send them only where S3 demands one.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # A private session: the default one is shared and not thread-safe to build
        # clients from, while the client itself is safe to share across threads.
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            region_name=settings.s3_region,
            config=config,
        )

    def _put_once(self, key: str, data: bytes) -> bool:
        attempt = 1
        while True:
            try:
                self.client.put_object(IfNoneMatch="*", **self._put_args(key, data))
                return True
            except self.errors.ClientError as exc:
                code = _error_code(exc)
                if code == "PreconditionFailed":
                    return False
                if code != "ConditionalRequestConflict" or attempt == _CONFLICT_ATTEMPTS:
                    raise self._unavailable(key, exc) from exc
            except self.errors.BotoCoreError as exc:
                raise self._unavailable(key, exc) from exc
            time.sleep(_CONFLICT_BACKOFF_SECONDS * 2 ** (attempt - 1))
            attempt += 1

    def _put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(**self._put_args(key, data))
        except (self.errors.ClientError, self.errors.BotoCoreError) as exc:
            raise self._unavailable(key, exc) from exc

    def _get(self, key: str) -> bytes | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._full_key(key))
            body: bytes = response["Body"].read()
            return body
        except self.errors.ClientError as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise self._unavailable(key, exc) from exc
        except self.errors.BotoCoreError as exc:
            raise self._unavailable(key, exc) from exc

    def _list(self, prefix: str) -> list[str]:
        cut = len(self._full_key(""))
        keys: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._full_key(prefix)
            )
            for page in pages:
                keys.extend(item["Key"][cut:] for item in page.get("Contents", []))
        except (self.errors.ClientError, self.errors.BotoCoreError) as exc:
            raise self._unavailable(prefix, exc) from exc
        return keys

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _put_args(self, key: str, data: bytes) -> dict[str, Any]:
        content_type = "application/json" if key.endswith(".json") else "application/octet-stream"
        return {
            "Bucket": self.bucket,
            "Key": self._full_key(key),
            "Body": data,
            "ContentType": content_type,
        }

    def _unavailable(self, key: str, exc: ClientError | BotoCoreError) -> StoreUnavailable:
        # Only the error code and message: neither boto3 nor S3 puts a secret there,
        # whereas request dumps (headers, string-to-sign) could carry one.
        if isinstance(exc, self.errors.ClientError):
            error = exc.response.get("Error", {})
            detail = f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")
        else:
            detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, self.errors.NoCredentialsError):
            detail += " (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or an AWS profile)"
        where = f" at {self.endpoint}" if self.endpoint else ""
        # botocore quotes the request URL in connection errors: redact all of it.
        return StoreUnavailable(
            redact_url(f"observation store {self.url}{where} failed on {key!r}: {detail}")
        )


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))

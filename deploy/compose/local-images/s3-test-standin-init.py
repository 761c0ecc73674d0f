"""One-shot job of deploy/compose/no-registry.yml (service minio-init, image
ouroboros-local/s3-test-standin): creates the observation bucket named by
OUROBOROS_OBSERVATIONS on the S3 TEST STAND-IN that replaces MinIO.

What deploy/compose/minio/minio-init.sh does on a real MinIO and this cannot:
create the writer and reader users and their policies. The stand-in has no users
(it accepts any credentials) and enforces no policy, so it says so loudly on every
run; deploy/README.md gives the commands that check the split on a real MinIO.
Safe to run again: an existing bucket is left as it is.
"""

import os
import sys

import boto3
from botocore.exceptions import ClientError

observations = os.environ.get("OUROBOROS_OBSERVATIONS", "")
if not observations.startswith("s3://"):
    sys.exit(
        f"s3-test-standin-init: OUROBOROS_OBSERVATIONS={observations} is not s3://bucket/prefix"
    )
bucket = observations.removeprefix("s3://").split("/", 1)[0]

client = boto3.client(
    "s3",
    endpoint_url="http://minio:9000",
    region_name="us-east-1",
    aws_access_key_id=os.environ["MINIO_ROOT_USER"],
    aws_secret_access_key=os.environ["MINIO_ROOT_PASSWORD"],
)
try:
    client.create_bucket(Bucket=bucket)
except ClientError as exc:
    if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
        raise
print(f"s3-test-standin-init: bucket {bucket} ready")
print(
    "s3-test-standin-init: TEST STAND-IN, not MinIO: no users and no policies were made; "
    "any credentials may read, write and delete"
)

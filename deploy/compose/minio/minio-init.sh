#!/bin/sh
# One-shot job of docker-compose.yml (service minio-init, image minio/mc): creates
# the observation bucket named by OUROBOROS_OBSERVATIONS and two MinIO users,
#   writer  (S3_WRITER_*): read, list and write objects; used by workers, the
#           reconciler and the schedule-lineage CLI;
#   reader  (S3_READER_*): read and list only; used by the web UI and Flower;
# neither may delete. Safe to run again: every step converges on the same state.
# Plain sh, coreutils and mc only: the mc image has no sed, grep, awk or jq.
set -eu

case "${OUROBOROS_OBSERVATIONS:-}" in
  s3://*) ;;
  *) echo "minio-init: OUROBOROS_OBSERVATIONS=${OUROBOROS_OBSERVATIONS:-} is not s3://bucket/prefix" >&2
     exit 1 ;;
esac
rest=${OUROBOROS_OBSERVATIONS#s3://}
bucket=${rest%%/*}

# Credentials through mc's environment alias rather than `mc alias set` arguments,
# which would show in the process list.
export MC_HOST_fleet="http://${MINIO_ROOT_USER}:${MINIO_ROOT_PASSWORD}@minio:9000"

mc mb --ignore-existing "fleet/${bucket}"

policy_file=$(mktemp)
trap 'rm -f "$policy_file"' EXIT

write_policy() { # name, object actions (JSON list)
  cat >"$policy_file" <<JSON
{
  "Version": "2012-10-17",
  "Statement": [
    {"Effect": "Allow",
     "Action": ["s3:GetBucketLocation", "s3:ListBucket"],
     "Resource": ["arn:aws:s3:::${bucket}"]},
    {"Effect": "Allow",
     "Action": $2,
     "Resource": ["arn:aws:s3:::${bucket}/*"]}
  ]
}
JSON
  mc admin policy create fleet "$1" "$policy_file"
}

ensure_user() { # access key, secret key, policy
  mc admin user add fleet "$1" "$2" >/dev/null
  if ! mc admin policy attach fleet "$3" --user "$1" >/dev/null 2>&1; then
    # Attaching twice is an error; anything else is a real failure.
    case "$(mc admin user info fleet "$1")" in
      *"$3"*) ;;
      *) echo "minio-init: cannot attach policy $3 to $1" >&2
         exit 1 ;;
    esac
  fi
}

write_policy ouroboros-writer '["s3:GetObject", "s3:PutObject"]'
write_policy ouroboros-reader '["s3:GetObject"]'
ensure_user "$S3_WRITER_ACCESS_KEY_ID" "$S3_WRITER_SECRET_ACCESS_KEY" ouroboros-writer
ensure_user "$S3_READER_ACCESS_KEY_ID" "$S3_READER_SECRET_ACCESS_KEY" ouroboros-reader
echo "minio-init: bucket ${bucket} ready; users writer and reader configured"

#!/usr/bin/env bash
# Prepares a docker host for docker-compose.yml: creates .env from .env.example
# with fresh random secrets, and the secrets directory the compose file mounts.
# Never overwrites anything: safe to run again.
set -euo pipefail
cd "$(dirname "$0")/../.."

secret() {
  # 48 hex characters: URL-safe, because the Redis password goes into the
  # broker URL and MinIO's into an mc host URL.
  od -An -N24 -tx1 /dev/urandom | tr -d ' \n'
}

if [ ! -e .env ]; then
  umask 077
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in
      REDIS_PASSWORD= | MINIO_ROOT_PASSWORD= | FLOWER_PASSWORD= | \
        S3_WRITER_SECRET_ACCESS_KEY= | S3_READER_SECRET_ACCESS_KEY=)
        printf '%s%s\n' "$line" "$(secret)" ;;
      MINIO_ROOT_USER=) printf '%s\n' "${line}fleet-admin" ;;
      S3_WRITER_ACCESS_KEY_ID=) printf '%s\n' "${line}ouroboros-writer" ;;
      S3_READER_ACCESS_KEY_ID=) printf '%s\n' "${line}ouroboros-reader" ;;
      FLOWER_USER=) printf '%s\n' "${line}admin" ;;
      *) printf '%s\n' "$line" ;;
    esac
  done <.env.example >.env
  echo "init-env: wrote .env with new secrets (mode 0600)"
else
  echo "init-env: .env exists; left as it is"
fi

secrets=$(sed -n 's/^FLEET_SECRETS_DIR=//p' .env | tail -n 1)
secrets=${secrets:-./secrets}
# The directory itself is private to this account. What is inside must be
# readable by the containers' users (uid 10001, nobody), which reach the files
# through bind mounts that do not pass through this directory's permissions.
install -d -m 0700 "$secrets"
install -d -m 0755 "$secrets/credentials" "$secrets/git"
if [ ! -e "$secrets/git/authorized_keys" ]; then
  install -m 0644 /dev/null "$secrets/git/authorized_keys"
fi

cat <<MSG
init-env: next steps
  - provider keys, one file each, mode 0644, named after the variable:
      $secrets/credentials/ANTHROPIC_API_KEY, OPENAI_API_KEY, OPENAI_COMPATIBLE_API_KEY
    (the scripted provider needs none)
  - ssh public keys of worker hosts on other machines: $secrets/git/authorized_keys
  - deploy/compose/build.sh && docker compose up -d
MSG

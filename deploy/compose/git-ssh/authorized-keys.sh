#!/bin/sh
# sshd AuthorizedKeysCommand of the git-ssh service: the public keys allowed to
# fetch from and push to the shared repository, from the mounted secrets file
# (FLEET_SECRETS_DIR/git/authorized_keys on the docker host). Keys are printed
# for the git account only.
set -eu
keys=/run/ouroboros/git/authorized_keys
if [ "${1:-}" = git ] && [ -r "$keys" ]; then
  exec cat "$keys"
fi
exit 0

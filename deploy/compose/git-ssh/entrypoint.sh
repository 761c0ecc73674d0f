#!/bin/sh
# Entrypoint of the git-ssh service: a persistent host key (on a volume, so that
# workers' known_hosts stay valid across container re-creation), then sshd in
# the foreground with its log on stderr.
set -eu
key=/etc/ssh/keys/ssh_host_ed25519_key
if [ ! -s "$key" ]; then
  ssh-keygen -q -t ed25519 -N '' -C "ouroboros-git-ssh" -f "$key"
fi
if [ ! -f /srv/git/lineages.git/HEAD ]; then
  echo "git-ssh: /srv/git/lineages.git does not exist yet (the repo-init service creates it)" >&2
  exit 1
fi
exec /usr/sbin/sshd -D -e -f /etc/ssh/sshd_config

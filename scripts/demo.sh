#!/usr/bin/env bash
# The main job on the embedded default: a private Redis on a Unix socket, a local
# bare repository and a file observation store under $OUROBOROS_HOME; two worker
# processes; three new lineages run for a few generations with the offline
# `scripted` model stand-in while progress is shown; then their journals, every
# generation replayed from its record, where to browse them, and a clean shutdown of
# everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."

export OUROBOROS_HOME="${OUROBOROS_HOME:-$PWD/.ouroboros}"
export OUROBOROS_MODEL_PROVIDER="${OUROBOROS_MODEL_PROVIDER:-scripted}"
# Bytecode lives only in the private, checked cache (worker/__init__.py says why); named
# here so that the packages' own __init__ files, compiled before they can say so, go there too.
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$HOME/.cache/ouroboros-fleet/pycache}"
generations="${DEMO_GENERATIONS:-4}"
bin="$PWD/.venv/bin"
logs="$OUROBOROS_HOME/logs"
mkdir -p "$logs"

workers=()
shutdown() {
  for pid in "${workers[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${workers[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -S "$OUROBOROS_HOME/redis/redis.sock" ]; then
    redis-cli -s "$OUROBOROS_HOME/redis/redis.sock" shutdown >/dev/null 2>&1 || true
  fi
  echo "demo: workers and the embedded Redis are stopped" >&2
}
trap shutdown EXIT

stamp=$(date +%Y%m%d-%H%M%S)
names=("demo-$stamp-a" "demo-$stamp-b" "demo-$stamp-c")
for name in "${names[@]}"; do
  "$bin/schedule-lineage" init "$name" --wall 60 --cpu-seconds 30 --memory-max 512M
done

for n in 1 2; do
  "$bin/celery" -A worker worker --concurrency 1 -n "demo$n@%h" --loglevel INFO \
    --logfile "$logs/worker-$n.log" >/dev/null 2>&1 &
  workers+=("$!")
done

"$bin/schedule-lineage" run "${names[@]}" --generations "$generations" --follow
"$bin/schedule-lineage" status "${names[@]}"

for name in "${names[@]}"; do
  echo
  echo "=== journal of $name ==="
  "$bin/schedule-lineage" journal "$name"
done

# Every generation lived again from its record on the same workers: the claim each
# record makes (this commit follows from that parent, those physics and those answers).
echo
for name in "${names[@]}"; do
  "$bin/schedule-lineage" replay "$name" --all --fleet
done

cat <<INFO

Browse these lineages:
  $bin/schedule-lineage serve                     # web UI on http://127.0.0.1:8765
  $bin/schedule-lineage observations ${names[0]}
  git --git-dir=$OUROBOROS_HOME/lineages.git log --oneline lineage-${names[0]}
  ls $OUROBOROS_HOME/observations/lineages/${names[0]}/generations
Worker logs: $logs
INFO

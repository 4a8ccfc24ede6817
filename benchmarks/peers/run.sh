#!/usr/bin/env bash
# bash benchmarks/peers/run.sh MINUTES [compare.py options]: megaformer against fairseq and OpenNMT-py on Multi30k,
# each trained for MINUTES with megaformer's recipe, one after the other (run it on an otherwise idle machine).
# Installs the peers first (install.sh; megaformer's own venv from `make install`). Prints one line per system and
# precision, appends them to runs/peers/results.jsonl and draws docs/peers.png from every run recorded there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/peers/run.sh MINUTES [--systems \"fairseq opennmt megaformer\"] [--precisions ...]" >&2
    exit 2
fi
minutes=$1
shift
cd "$root"
make --no-print-directory install
bash "$here/install.sh"
exec .venv/bin/python "$here/compare.py" --minutes "$minutes" "$@"

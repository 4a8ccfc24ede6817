#!/usr/bin/env bash
# The peers, each in its own venv under PEERS_HOME (default .peers/ at the repository root), on the same CPU build of
# torch as megaformer's (TORCH_SPEC; pip's cache makes the second install quick). Idempotent: a venv whose marker
# exists is kept.
#   fairseq: fairseq-fixed 0.12.3.1 (fairseq 0.12.2's sdist fails to build: a C++ file is missing from it). Installed
#            --no-deps with its dependencies listed here, less torchaudio (its speech tasks only; translation never
#            imports it, and torchaudio's wheels would pull another torch).
#   OpenNMT-py 3.5.1: pins torch < 2.3 but trains, averages and translates on torch 2.13, so it is installed
#            --no-deps with the rest of its dependencies (its transforms import spacy and fasttext at start).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PEERS_HOME=${PEERS_HOME:-$root/.peers}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
mkdir -p "$PEERS_HOME"
export PIP_NO_WARN_SCRIPT_LOCATION=1
quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }  # this machine's pip config names absent indexes

venv() {  # venv NAME: a fresh venv with torch, unless NAME/.installed exists
    local dir="$PEERS_HOME/$1"
    [ -f "$dir/.installed" ] && return 1
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    quiet "$dir/bin/pip" install --quiet --upgrade pip setuptools wheel
    quiet "$dir/bin/pip" install --quiet "$TORCH_SPEC"
}

if venv fairseq; then
    echo "install.sh: fairseq-fixed 0.12.3.1 -> $PEERS_HOME/fairseq (builds its C extensions: a few minutes)"
    pip=(quiet "$PEERS_HOME/fairseq/bin/pip" install --quiet)
    "${pip[@]}" cython "numpy<2" cffi
    "${pip[@]}" --no-deps --no-build-isolation fairseq-fixed==0.12.3.1
    "${pip[@]}" "hydra-core==1.3.2" "omegaconf==2.3.0" regex "sacrebleu>=2.4" tqdm bitarray packaging scikit-learn \
        sentencepiece
    "$PEERS_HOME/fairseq/bin/python" -c "import fairseq, fairseq_cli.train"
    touch "$PEERS_HOME/fairseq/.installed"
fi

if venv opennmt; then
    echo "install.sh: OpenNMT-py 3.5.1 -> $PEERS_HOME/opennmt"
    pip=(quiet "$PEERS_HOME/opennmt/bin/pip" install --quiet)
    "${pip[@]}" --no-deps OpenNMT-py==3.5.1
    "${pip[@]}" configargparse "ctranslate2>=4,<5" "pyonmttok>=1.37,<2" pyyaml "sacrebleu>=2.4" rapidfuzz \
        pyahocorasick six tensorboard flask waitress fasttext-wheel spacy sentencepiece "numpy<2"
    "$PEERS_HOME/opennmt/bin/python" -c "import onmt.bin.train, onmt.bin.translate, onmt.bin.average_models"
    touch "$PEERS_HOME/opennmt/.installed"
fi
if [ ! -f "$PEERS_HOME/plot/.installed" ]; then  # matplotlib for plot.py, no torch
    rm -rf "$PEERS_HOME/plot" && "$PYTHON" -m venv "$PEERS_HOME/plot"
    quiet "$PEERS_HOME/plot/bin/pip" install --quiet matplotlib
    touch "$PEERS_HOME/plot/.installed"
fi
echo "install.sh: peers ready in $PEERS_HOME"

#!/usr/bin/env bash
# System packages the tests use: the Compose tool (docker-compose.yml checks), a headless browser with
# its driver (the UI tests), Fashion-MNIST and WordNet (the image and language-model recipes' real data,
# pipeline/data/packaged.py).
# Installed when missing (as root, or through sudo); `make test` runs this first.
set -euo pipefail
missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
[ -f /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz ] || missing+=(dataset-fashion-mnist)
[ -f /usr/share/wordnet/data.adv ] || missing+=(wordnet-base)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "missing system packages: ${missing[*]} (apt-get install -y ${missing[*]} as root)" >&2; exit 1; }
    sudo_cmd=(sudo)
fi
echo "installing system packages the tests use: ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"

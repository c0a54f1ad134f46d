#!/usr/bin/env bash
# On the offline GPU machine: unpack vLLM chunks built by benchmarks/vllm_carry.sh.
#   bash benchmarks/vllm_install.sh 1 [2 ...]     (or part-1.tar.xz; run with carry: [".carry/vllm/part-1.tar.xz"])
# Chunks land in /tmp/vllm-site, which survives between back-to-back calls while the
# machine stays warm, so each call may bring just one chunk. Nothing is pip-installed:
# use PYTHONPATH=/tmp/vllm-site so the image's torch/triton/transformers stay untouched.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=${VLLM_SITE:-/tmp/vllm-site}
mkdir -p "$SITE"
for a in "$@"; do
  n=${a##*part-}; n=${n%%.tar.xz}              # accept 1, part-1, .carry/vllm/part-1.tar.xz
  if compgen -G "$SITE/.vllm-carry/part-$n-of-*" > /dev/null; then
    echo "part-$n already in $SITE"; continue  # idempotent: each chunk has a marker file
  fi
  f=$ROOT/.carry/vllm/part-$n.tar.xz
  [[ -f $f ]] || { echo "missing $f (name it in run's carry)" >&2; exit 1; }
  xz -dc -T0 "$f" | tar -xf - -C "$SITE"
  echo "extracted part-$n into $SITE"
done

# All chunks present? Each marker is part-I-of-N.
shopt -s nullglob; marks=("$SITE"/.vllm-carry/part-*-of-*)
[[ ${#marks[@]} -gt 0 ]] || exit 0
total=${marks[0]##*-of-}
if (( ${#marks[@]} < total )); then echo "have ${#marks[@]}/$total chunks"; exit 0; fi

PYTHONPATH=$SITE python3 -c 'import vllm; print("vllm", vllm.__version__, "from", vllm.__file__)'
# Conflicts: a carried dist that the image also has (ours shadows it under PYTHONPATH),
# and requirements of carried dists / installed versions vLLM pins that are not met.
PYTHONPATH=$SITE python3 - "$SITE" <<'PY'
import sys, os, subprocess, importlib.metadata as md
from packaging.requirements import Requirement
site = sys.argv[1]
carried = {d.metadata["Name"].lower().replace("_", "-"): d for d in md.distributions(path=[site])}
base = {d.metadata["Name"].lower().replace("_", "-") for d in md.distributions(path=[p for p in sys.path if p != site])}
shadow = sorted(set(carried) & base)
if shadow:
    print("carried dists that shadow the image's:", shadow)
    subprocess.run([sys.executable, "-m", "pip", "show", *shadow], env={**os.environ, "PYTHONPATH": ""})
bad = []
for name, d in carried.items():
    for r in map(Requirement, d.requires or []):
        if r.marker and not r.marker.evaluate({"extra": ""}): continue
        try: v = md.version(r.name)
        except md.PackageNotFoundError:
            if name != "vllm": bad.append(f"{name} needs {r} (absent)")  # vllm's absent extras are on purpose
            continue
        if r.specifier and not r.specifier.contains(v, prereleases=True): bad.append(f"{name} needs {r}, have {v}")
print("unmet requirements:" if bad else "no version conflicts", *bad, sep="\n  ")
PY

#!/usr/bin/env bash
# Build vLLM 0.25.1 as a few <=60 MiB tar.xz chunks for the offline GPU machine
# (each run call carries at most 64 MiB). Output: .carry/vllm/part-N.tar.xz + MANIFEST.
# On the GPU machine: `bash benchmarks/vllm_install.sh N` per call, then
# PYTHONPATH=/tmp/vllm-site python3 ...   (its torch/triton/transformers are used as-is).
# Env: VPACK (scratch, default /tmp/vpack), VLLM_WHL (pre-downloaded wheel),
#      PYVER (3.12 for the GPU machine; 3.11 builds a local import-check site only),
#      PACK=0 (stop after staging the site dir).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/.carry/vllm
PYVER=${PYVER:-3.12}
WORK=${VPACK:-/tmp/vpack}/build-py$PYVER
SITE=$WORK/site
VLLM_VER=0.25.1
VLLM_WHL=${VLLM_WHL:-/tmp/vw/vllm-$VLLM_VER-cp38-abi3-manylinux_2_28_x86_64.whl}
MAX=$((60 * 1024 * 1024))   # hard cap per chunk
BIN_MIB=${BIN_MIB:-50}       # packing target: a run call carries chunk + working tree (~10 MiB) <= 64 MiB
SM=${SM:-90}                 # Hopper

# Deps that vLLM imports at startup on the LLM(...)->generate path (V1 engine,
# multiproc TP workers) and that the GPU image lacks. Everything else vLLM
# Requires-Dist is either already on the image (torch, triton, transformers,
# numpy, tokenizers, safetensors, aiohttp, psutil, ...: never carried, never
# shadowed) or only imported lazily / behind try-except (flashinfer, xgrammar,
# llguidance, mistral_common, compressed-tensors, tilelang, cutlass-dsl, ...).
DEPS=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5  # vllm.config
  msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.1             # engine IPC/serialization
  blake3==1.0.11                                      # hashing (mm hasher; cheap insurance)
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1  # chat_utils types; 2.x uses the image's httpx (3.x needs httpx2)
  openai-harmony==0.0.8                               # imported at module level by gpt-oss helpers on the engine path
  fastapi==0.136.3 starlette==1.10.0                  # entrypoints.pooling.factories imports fastapi at top level
  partial-json-parser==0.2.1.1.post7                  # tool/reasoning parser registry imported by LLM
  depyf==0.20.0 astor==0.8.1 dill==0.4.1              # only if run without enforce_eager (torch.compile path)
)

# 1. wheels: vLLM (abi3) + pinned deps for CPython $PYVER / manylinux x86_64, no resolution.
mkdir -p "$WORK/wheels" "$OUT"
if [[ ! -f $VLLM_WHL ]]; then
  python3 -m pip download --no-deps -d "$WORK/wheels" "vllm==$VLLM_VER"
  VLLM_WHL=$(ls "$WORK"/wheels/vllm-$VLLM_VER-*.whl)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK/wheels" "${DEPS[@]}"

# 2. stage one flat site dir (what PYTHONPATH will point at); dist-info kept so
#    importlib.metadata (versions, vllm.general_plugins entry points) works.
rm -rf "$SITE" && mkdir -p "$SITE"
for w in "$VLLM_WHL" "$WORK"/wheels/*.whl; do
  [[ $(basename "$w") == vllm-* && $w != "$VLLM_WHL" ]] && continue
  python3 -m zipfile -e "$w" "$SITE"
done
rm -rf "$SITE"/bin  # console-script stubs are useless here

# 3. slim vLLM for a dense bf16 model on sm_90 (checked by reading the import sites):
V=$SITE/vllm
rm -f "$V"/vllm_flash_attn/_vllm_fa2_C.abi3.so  # FA2: sm90 picks FA3 (fa_utils.get_flash_attn_version), also in batch-invariant mode
rm -f "$V"/_moe_C_stable_libtorch.abi3.so       # MoE ops: import_kernels() suppresses ImportError; _custom_ops uses hasattr guards
rm -f "$V"/vllm-rs                              # Rust HTTP frontend binary, only for `vllm serve` with VLLM_USE_RUST_FRONTEND
rm -f "$V"/_flashmla_C.abi3.so "$V"/_flashmla_extension_C.abi3.so  # MLA (DeepSeek) only, try/except ImportError
rm -f "$V"/_qutlass_C.abi3.so                   # FP4 (QuTLASS), contextlib.suppress(ImportError)
rm -f "$V"/_rust_tool_parser.abi3.so            # server tool-call parser, importlib on demand
rm -rf "$V"/third_party/deep_gemm               # FP8 GEMM: 5 CPython builds + CUTLASS headers; absent => has_deep_gemm() False
rm -rf "$V"/third_party/fmha_sm100              # Blackwell sparse attention (MiniMax-M3), imported lazily
rm -rf "$V"/entrypoints/serve/instrumentator/static  # swagger UI of the HTTP server (offline_docs checks exists())
# Kept: _C_stable_libtorch (custom ops, imported unconditionally by platforms/cuda.py),
# _vllm_fa3_C (models import vllm_flash_attn at module level on CUDA: needs FA2 or FA3),
# cumem_allocator/spinloop/fs_io_C (tiny), all Python code, third_party/pynvml.py.

# 4. structured-output backends annotate class fields with LazyLoader'ed xgrammar /
#    llguidance types, which forces those (uncarried) packages to import at startup;
#    postponed annotations keep them lazy (only needed for guided decoding).
for f in backend_xgrammar.py backend_guidance.py; do
  grep -q '^from __future__ import annotations' "$V/v1/structured_output/$f" ||
    sed -i '0,/^import /s//from __future__ import annotations\n\nimport /' "$V/v1/structured_output/$f"
done
# The sampler (TopKTopPSampler.__init__, on every CUDA worker) imports the FlashInfer
# attention backend unguarded ("assumes flashinfer is installed"); fall back to the
# native sampler when flashinfer is absent (same as VLLM_USE_FLASHINFER_SAMPLER=0).
python3 - "$V/v1/sample/ops/topk_topp_sampler.py" <<'PY'
import sys; p = sys.argv[1]; s = open(p).read()
old = "    from vllm.v1.attention.backends.flashinfer import FlashInferBackend\n"
new = ("    try:\n        from vllm.v1.attention.backends.flashinfer import FlashInferBackend\n"
       "    except ImportError:  # flashinfer not carried\n        return False\n")
if new not in s:
    assert s.count(old) == 1, "topk_topp_sampler.py changed upstream"; open(p, "w").write(s.replace(old, new))
PY
# 5. Keep only the sm_$SM cubins of the CUDA fatbins (_C_stable_libtorch: 54 -> ~15 MB xz).
#    A fatbin container (one .cu file) with no sm_$SM cubin keeps just one small ELF,
#    i.e. stays unloadable on sm_$SM: those are Marlin/GPTQ/AWQ and sm89 int8/fp8
#    CUTLASS kernels (quantized models only) whose PTX the driver would otherwise JIT.
#    Containers are compacted in place (same ELF layout, zero tail); the kept sm_90
#    cubins are byte-identical (checked with cuobjdump -xelf sm_90).
for so in $(find "$V" -name '*.so'); do
  python3 - "$so" "$SM" <<'PY'
import struct, sys
path, sm = sys.argv[1], int(sys.argv[2]); d = bytearray(open(path, "rb").read())
shoff, = struct.unpack_from("<Q", d, 0x28); shes, shn, stri = struct.unpack_from("<HHH", d, 0x3A)
sh = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shes) for i in range(shn)]
name = lambda s: d[sh[stri][4] + s[0]: d.index(b"\0", sh[stri][4] + s[0])].decode()
sec = [s for s in sh if name(s) == ".nv_fatbin"]
if not sec: sys.exit(0)
p, end, before, after = sec[0][4], sec[0][4] + sec[0][5], 0, 0
while p + 16 <= end:
    magic, _, hsz, body = struct.unpack_from("<IHHQ", d, p)
    if magic != 0xBA55ED50: p += 8; continue            # padding between containers
    ents, q = [], p + hsz
    while q < p + hsz + body:                           # entry: kind(1 PTX, 2 ELF), hdr, payload, arch@28
        kind, _, ehsz, psz = struct.unpack_from("<HHIQ", d, q); arch, = struct.unpack_from("<I", d, q + 28)
        ents.append((kind, arch, bytes(d[q:q + ehsz + psz]))); q += ehsz + psz
    assert q == p + hsz + body, path
    elf = [e for e in ents if e[0] == 2]
    keep = [e for e in elf if e[1] == sm] or sorted(elf, key=lambda e: len(e[2]))[:1] or ents
    blob = b"".join(e[2] for e in keep); before += body; after += len(blob)
    d[p + hsz:p + hsz + body] = blob + bytes(body - len(blob)); struct.pack_into("<Q", d, p + 8, len(blob))
    p = q
open(path, "wb").write(d); print(f"fatbin sm_{sm}: {path.split('/site/')[-1]} {before >> 20} -> {after >> 20} MiB")
PY
done
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
[[ ${PACK:-1} == 0 ]] && { echo "staged $SITE"; exit 0; }

# 6. split into chunks of whole files: measure xz size of every file >= 4 MiB and of
#    the tar of all small files, first-fit-decreasing into $BIN_MIB MiB bins.
rm -f "$OUT"/part-*.tar.xz "$OUT"/MANIFEST
python3 - "$SITE" "$WORK" "$BIN_MIB" <<'PY'
import os, subprocess, sys, concurrent.futures as cf
site, work, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]) << 20
files = sorted(os.path.relpath(os.path.join(d, f), site) for d, _, fs in os.walk(site) for f in fs)
big = [f for f in files if os.path.getsize(os.path.join(site, f)) >= 4 << 20]
small = [f for f in files if f not in set(big)]
def xz_size(args):
    cmd = f"tar -C '{site}' -cf - -T - | xz -9e -T1 -c | wc -c"
    return int(subprocess.run(cmd, shell=True, input="\n".join(args), text=True,
                              capture_output=True, check=True).stdout)
items = [[f] for f in big] + [small]
with cf.ThreadPoolExecutor(os.cpu_count()) as ex:
    sizes = list(ex.map(xz_size, items))
bins = []  # [est, [files]]
for s, it in sorted(zip(sizes, items), key=lambda t: -t[0]):
    b = next((b for b in bins if b[0] + s <= cap), None)
    if b is None:
        if s > cap: sys.exit(f"item too large for a chunk: {it[:3]} {s}")
        bins.append(b := [0, []])
    b[0] += s; b[1] += it
for i, (s, fl) in enumerate(bins, 1):
    open(f"{work}/part-{i}.list", "w").write("\n".join(fl) + "\n")
    print(f"part-{i}: est {s / 2**20:.1f} MiB, {len(fl)} files")
open(f"{work}/nparts", "w").write(str(len(bins)))
PY
N=$(cat "$WORK/nparts")
rm -rf "$WORK/markers" && mkdir -p "$WORK/markers/.vllm-carry"
{
  echo "# vLLM $VLLM_VER carry for CPython $PYVER, built $(date -u +%FT%TZ) by benchmarks/vllm_carry.sh"
  echo "# install: bash benchmarks/vllm_install.sh 1 .. $N  -> /tmp/vllm-site"
  echo "carried dists: $(cd "$SITE" && ls -d *.dist-info | sed 's/\.dist-info//' | tr '\n' ' ')"
} > "$OUT/MANIFEST"
for i in $(seq 1 "$N"); do
  # each chunk carries a marker so the installer knows when all N are in place
  m=.vllm-carry/part-$i-of-$N; touch "$WORK/markers/$m"
  tar -cf - -C "$SITE" -T "$WORK/part-$i.list" -C "$WORK/markers" "$m" | xz -9e -T0 > "$OUT/part-$i.tar.xz"
  sz=$(stat -c %s "$OUT/part-$i.tar.xz")
  (( sz <= MAX )) || { echo "part-$i is $sz bytes > 60 MiB" >&2; exit 1; }
  {
    echo; echo "part-$i.tar.xz  $sz bytes ($((sz / 1048576)) MiB)  sha256 $(sha256sum "$OUT/part-$i.tar.xz" | cut -c1-64)"
    echo "  top-level: $(cut -d/ -f1 "$WORK/part-$i.list" | sort -u | tr '\n' ' ')"
    (cd "$SITE" && xargs -a "$WORK/part-$i.list" -d '\n' stat -c '%s %n' | awk '$1 >= 4194304 {printf "  big: %s (%d MiB raw)\n", $2, $1/1048576}')
  } >> "$OUT/MANIFEST"
done
cat "$OUT/MANIFEST"

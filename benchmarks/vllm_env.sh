# Sourced by the GPU scripts: puts the carried vLLM (benchmarks/vllm_install.sh -> /tmp/vllm-site)
# and this checkout on PYTHONPATH. repaudit is not pip-installed there, so vLLM would not see its
# plugin entry point: a dist-info holding only that entry point is written next to vLLM, which
# is what `pip install repaudit` gives importlib.metadata.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SITE=${SITE:-/tmp/vllm-site}
export PYTHONPATH="$SITE:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" REPAUDIT_CACHE=${REPAUDIT_CACHE:-/tmp/repaudit-cache}
ver=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
dist="$SITE/repaudit-$ver.dist-info"
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: repaudit\nVersion: %s\n' "$ver" > "$dist/METADATA"
# entry_points.txt is INI: `name = module:attr` with no quotes, unlike pyproject's TOML string.
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml \
    | sed -e 's/^\[project.entry-points."\(.*\)"\]/[\1]/' -e 's/"//g' > "$dist/entry_points.txt"

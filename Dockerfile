# GPU image for moe-lab:
#   docker build -t moe-lab .
#   docker run --gpus all --shm-size 16g -v $PWD/outputs:/workspace/moe-lab/outputs moe-lab hardware=deepspeed_zero3 ...
# CUDA devel base: DeepSpeed compiles its fused ops (Adam, CPU Adam for ZeRO-Offload) with nvcc at first use.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    WANDB_DIR=/workspace/moe-lab/outputs TORCH_EXTENSIONS_DIR=/opt/torch_extensions
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git build-essential \
        ninja-build libaio-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /workspace/moe-lab
# the CUDA build of the pinned torch first (pyproject's range accepts it), then moe-lab with its extras
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY moe_lab ./moe_lab
RUN pip install -e ".[dev]" && python -c "import torch, deepspeed, lightning, transformers"
COPY . .

ENTRYPOINT ["python", "run.py"]
CMD ["hardware=gpu"]

# GPU image for moe-lab: docker build -t moe-lab . && docker run --gpus all moe-lab [hydra overrides]
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /workspace/moe-lab
# CUDA build of the pinned torch first, then the project (its torch range is already satisfied)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY moe_lab ./moe_lab
RUN pip install -e ".[dev]"
COPY . .

ENTRYPOINT ["python", "run.py"]
CMD ["hardware=gpu"]

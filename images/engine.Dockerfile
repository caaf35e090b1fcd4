# The engine image: kvfleet-engine on CUDA (torch + triton), also the init container that
# downloads hf:// models. With no GPU visible the engine runs on the CPU (`--device auto`), so the
# built-in demo model (an InferenceService with an empty model.source) runs anywhere.
#
#   docker build -f images/engine.Dockerfile -t ghcr.io/kvfleet/engine:0.1.0 .
#
# A CPU-only image (kind, laptops; about a tenth of the size):
#
#   docker build -f images/engine.Dockerfile -t kvfleet/engine:cpu \
#     --build-arg BASE_IMAGE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .

# The torch build must match the base's CUDA (cu128 wheels on CUDA 12.8); these are the versions
# bench/RESULTS.md was measured with.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM ${BASE_IMAGE}
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc, libc6-dev and the Python headers: Triton compiles its small C launcher at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch (and the triton it pins) in a layer of their own: the largest, and the most stable.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
COPY router/ router/
COPY protocol/ protocol/
RUN pip install --no-cache-dir . \
    && python -c "import kvfleet.engine.cli, torch; torch.version.cuda is None or __import__('triton')" \
    && rm -rf /src
WORKDIR /
# Pods run with a read-only root filesystem and an emptyDir at /tmp (operator/resources.py):
# every cache (the demo model, Triton kernels, Hugging Face) goes there.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    KVFLEET_CACHE_DIR=/tmp/kvfleet \
    TRITON_CACHE_DIR=/tmp/.triton
# uid 1000 is the user InferenceService pods run as (runAsUser in operator/resources.py).
USER 1000:1000
EXPOSE 8000
CMD ["kvfleet-engine", "serve", "--host", "0.0.0.0", "--port", "8000"]

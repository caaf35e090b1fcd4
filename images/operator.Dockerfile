# The operator image: kvfleet-operator and kvfleet-router (the operator runs this image as every
# InferenceService's router). Lean: the operator's and router's dependencies only, no torch.
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvfleet/operator:0.1.0 .
#
# BASE_IMAGE: any Debian-like image with python3 (3.11+) and its venv module; `make images` builds
# from a local Debian base instead (images/build_base.sh) where no registry is reachable.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# On every stage: images/build.sh removes the images of earlier builds by this label.
LABEL org.opencontainers.image.vendor=kvfleet
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
# The dependencies in a layer of their own: it is rebuilt when they change, not the source.
COPY images/operator-requirements.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/operator-requirements.txt
# The build context is the source folders alone (.dockerignore): every kvfleet package comes
# along without a COPY line per folder.
COPY . /src
# --no-deps: the engine's dependencies (torch, transformers) stay out of this image.
RUN pip install --no-cache-dir --no-deps /src \
    && python -c "import kvfleet.operator.main, kvfleet.router.main"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.vendor=kvfleet
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    USER=kvfleet
# A numeric user, so that runAsNonRoot can verify it; the chart runs the operator as 65532 and
# the operator runs routers as its pods' uid (operator/resources.py RUN_AS): both work. No passwd
# entry names such a uid: USER answers getpass.getuser() (kopf's peering identity) instead.
USER 65532:65532
EXPOSE 8080 8081
CMD ["kvfleet-operator", "run"]

# The operator image: kvfleet-operator and kvfleet-router (the operator runs this image as every
# InferenceService's router). Slim: the operator's and router's dependencies only, no torch.
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvfleet/operator:0.1.0 .

FROM python:3.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY images/operator-requirements.txt ./
RUN pip install --no-cache-dir -r operator-requirements.txt
COPY pyproject.toml setup.py README.md ./
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
COPY router/ router/
COPY protocol/ protocol/
# --no-deps: the engine's dependencies (torch, transformers) stay out of this image.
RUN pip install --no-cache-dir --no-deps . \
    && python -c "import kvfleet.operator.main, kvfleet.router.main"

FROM python:3.12-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
COPY --from=build /opt/venv /opt/venv
# A numeric user, so that runAsNonRoot can verify it; pods may run it as any other uid.
USER 65532:65532
EXPOSE 8080 8081
CMD ["kvfleet-operator", "run"]

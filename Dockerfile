# One image for every pdserve service; docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app
# torch first, pinned, so nothing later pulls another build. Pass TORCH_INDEX (a CPU-only wheel
# index) to keep the image small; without it pip takes PyPI's default (CUDA) build.
ARG TORCH_INDEX=""
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_INDEX:+--index-url $TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir .
ENV PDSERVE_HOME=/models
# fetch the default model at build time so containers start offline
RUN pdserve model pull

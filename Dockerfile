# One image for every trainq process: the API, the one-shot migration, and the GPU workers.
#
#   docker build -t trainq .                    # CPU build of PyTorch (small; API-only hosts)
#   docker build -t trainq --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# PyTorch is installed first, from TORCH_INDEX, so the CUDA build you choose is the one
# kept: trainq itself accepts any torch >= 2.6 and pip then leaves it alone.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.6"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRAINQ_DATA_ROOT=/data \
    TRAINQ_RUNS_ROOT=/runs

RUN pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"

WORKDIR /opt/trainq
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
COPY trainer ./trainer
COPY migrations ./migrations
# hf: transformers and safetensors, so a worker writes the Hugging Face folder of each
# finished run (`trainq download --format hf`); tb: TensorBoard curves.
RUN pip install ".[tb,hf]" && rm -rf build ./*.egg-info

# Never root: a worker runs user training code.
RUN useradd --create-home --uid 10001 trainq \
    && mkdir -p /data /runs \
    && chown trainq:trainq /data /runs
USER trainq
WORKDIR /home/trainq

EXPOSE 8000
# The API by default (auth is on unless TRAINQ_AUTH=off); compose names each command.
CMD ["trainq", "api", "--host", "0.0.0.0", "--port", "8000"]

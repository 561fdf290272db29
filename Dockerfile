# plait's image for the Kubernetes Job (launchers/k8s/job.yaml, docs/launching.md): plait and its
# main dependencies on a CUDA PyTorch base image, the repository's configs and launchers beside them.
#
#   docker build -t your-registry/plait:latest .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<torch>-cuda<cuda>-cudnn9-runtime \
#                --build-arg EXTRAS=data,wandb -t your-registry/plait:latest .
#
# BASE_IMAGE must carry torch >= 2.11 built for the nodes' CUDA, so that pip keeps it instead of
# installing another torch. EXTRAS names optional extras from pyproject.toml (data, hf, wandb, mlflow, te...).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The Job runs `bash launchers/k8s/entrypoint.sh CONFIG ...` from here.
WORKDIR /opt/plait

# The package (what pyproject.toml installs), then the dependencies and plait itself.
COPY pyproject.toml README.md ./
COPY core ./core
COPY plugins ./plugins
COPY model_specs ./model_specs
RUN python -m pip install ".${EXTRAS:+[${EXTRAS}]}" \
 && python -m core.plugins > /dev/null

# Run configs and launchers (not part of the package).
COPY train_configs ./train_configs
COPY launchers ./launchers

ENTRYPOINT ["bash", "launchers/k8s/entrypoint.sh"]

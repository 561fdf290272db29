"""The image build (Dockerfile at the root) against the repository and the Kubernetes Job, without docker:
every COPY source exists and is in the build context, the package is complete before pip installs it,
and the Job's image, command and config are the ones the Dockerfile builds and holds."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def ignored(name: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def job() -> str:
    return (REPO / "launchers" / "k8s" / "job.yaml").read_text()


def test_every_copy_source_exists_and_is_in_the_build_context():
    copies = [shlex.split(rest) for word, rest in instructions() if word == "COPY"]
    assert copies
    for *sources, _dest in copies:
        for s in sources:
            assert (REPO / s).exists(), f"COPY {s}: no such file in the repository"
            assert not ignored(s), f"COPY {s}: excluded by .dockerignore"


def test_the_package_is_complete_before_pip_installs_it():
    steps = instructions()
    pip = next(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "pip install" in rest)
    copied = {s for word, rest in steps[:pip] if word == "COPY" for s in shlex.split(rest)[:-1]}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"pyproject.toml", project["project"]["readme"]} | packages <= copied
    base = dict(rest.split("=", 1) for word, rest in steps if word == "ARG" and "=" in rest)["BASE_IMAGE"]
    assert base.startswith("pytorch/pytorch:") and "cuda" in base  # a CUDA PyTorch base image
    torch_min = next(d for d in project["project"]["dependencies"] if d.startswith("torch>="))[len("torch>=") :]
    assert tuple(map(int, base.split(":")[1].split("-")[0].split(".")[:2])) >= tuple(map(int, torch_min.split(".")[:2]))


def test_the_k8s_job_runs_what_the_image_holds():
    steps = instructions()
    entrypoint = json.loads(next(rest for word, rest in steps if word == "ENTRYPOINT"))
    command = json.loads(re.search(r"^\s*command:\s*(\[.*\])\s*$", job(), re.M).group(1))
    args = json.loads(re.search(r"^\s*args:\s*(\[.*\])\s*$", job(), re.M).group(1))
    assert command == entrypoint == ["bash", "launchers/k8s/entrypoint.sh"]
    workdir = next(rest for word, rest in steps if word == "WORKDIR")
    copied_to = {shlex.split(rest)[-1].rstrip("/").removeprefix("./"): shlex.split(rest)[:-1] for word, rest in steps if word == "COPY"}
    # the script and the config the Job names are copied into the working directory, where the relative paths point
    for path in (command[1], args[0]):
        top = path.split("/")[0]
        assert copied_to.get(top) == [top] and (REPO / path).is_file(), f"{path}: not in the image under {workdir}"
    image = re.search(r"^\s*image:\s*(\S+)\s*$", job(), re.M).group(1)
    assert f"docker build -t {image} ." in (REPO / "Dockerfile").read_text()
    assert f"docker build -t {image} ." in (REPO / "docs" / "launching.md").read_text()


def test_what_the_launchers_source_is_in_the_image():
    """remote.sh and the k8s entrypoint share a helper they source (launchers/wait_for_job.sh): it must
    exist where each looks for it, and be copied into the image beside the entrypoint."""
    copied_to = {shlex.split(rest)[-1].rstrip("/").removeprefix("./"): shlex.split(rest)[:-1] for word, rest in instructions() if word == "COPY"}
    for script, base in (("launchers/remote.sh", REPO), ("launchers/k8s/entrypoint.sh", REPO / "launchers" / "k8s")):
        sourced = re.findall(r'^source "?(?:\$\(dirname "\$0"\)/)?([^"\s]+)"?', (REPO / script).read_text(), re.M)
        assert sourced, script
        for path in sourced:
            helper = (base / path).resolve()
            assert helper.is_file(), f"{script} sources {path}: no such file"
            top = helper.relative_to(REPO).parts[0]
            assert copied_to.get(top) == [top], f"{script} sources {path}, which the image does not hold"
